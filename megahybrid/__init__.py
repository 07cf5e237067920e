"""megahybrid: distributed pretraining for Interdomain Attention and NAtS-L hybrid token mixers."""
import warnings

# megatron-core warns at import that TransformerEngine and Apex are absent; we use neither, by design.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed", category=UserWarning)

__version__ = "0.1.0"
