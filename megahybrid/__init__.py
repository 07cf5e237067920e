"""megahybrid: distributed pretraining for Interdomain Attention and NAtS-L hybrid token mixers."""

__version__ = "0.1.0"
