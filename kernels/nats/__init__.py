"""NAtS-L token-mixing ops: chunk-selected Gated DeltaNet and attention over selected chunks (see README.md)."""
import importlib.util
from pathlib import Path

from kernels.nats.gdn import chunk_selected_gdn, chunk_selected_gdn_step

__all__ = ["chunk_selected_gdn", "chunk_selected_gdn_step"]

# The attention branch lives in its own package; export it only once that package exists.
if (Path(__file__).parent / "attention" / "__init__.py").exists() and importlib.util.find_spec(
        "kernels.nats.attention") is not None:
    from kernels.nats.attention import chunk_selected_attention

    __all__.append("chunk_selected_attention")
