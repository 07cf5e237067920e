"""megahybrid: distributed pretraining for Interdomain Attention and NAtS-L hybrid token mixers."""
import logging
import warnings

# megatron-core warns at import that TransformerEngine and Apex are absent; we use neither, by design.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed", category=UserWarning)
warnings.filterwarnings("ignore", message="Apex is not installed. Falling back to Torch Norm", category=UserWarning)

# DeepSpeed warnings every run would print and that say nothing to act on: that it runs on the CPU without a GPU
# (the start line says device=cpu), and that ZeRO runs an optimizer it has not tested (torch's AdamW, which our
# ZeRO 1/2/3 tests run). A filter on its named logger, set before DeepSpeed creates it, outlives its setLevel.
_DEEPSPEED_NOTES = ("Setting accelerator to CPU", "ZeRO with an untested optimizer")
logging.getLogger("DeepSpeed").addFilter(lambda record: not any(n in record.getMessage() for n in _DEEPSPEED_NOTES))

__version__ = "0.1.0"
