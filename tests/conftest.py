import os

# Triton kernels run in the interpreter when no GPU is present; this must be set before triton is imported.
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:
    pass
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
# One torch.compile cache for every test's training runs (their run directories are new each time, and a trainer
# otherwise caches under its run directory: train.compile_cache); tests of that default remove the variable.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(__import__("tempfile").gettempdir(),
                                                              "megahybrid-tests-inductor"))

from tests.utils import nan_empty  # noqa: E402,F401  (fixture)
