"""A saved model (any layout or format) as a tp = 1 GPTModel in eval mode, with its tokenizer."""
import json
import os
from dataclasses import dataclass

import torch

from megahybrid.convert import sources
from megahybrid.convert.local import ensure_local_groups
from megahybrid.data.tokenizer import SentencePieceTokenizer
from megahybrid.errors import UserError
from megahybrid.model.gpt import build_model
from megahybrid.parallel import ParallelLayout


@dataclass
class Loaded:
    model: object  # GPTModel, eval mode, on `device`
    cfg: object  # ModelConfig (seq_length: the training context)
    path: str
    step: int | None  # the training step, when the source records it
    tokenizer_model: str | None
    device: torch.device

    @property
    def name(self) -> str:
        """A short label: the step directory, or the directory name of another source."""
        return os.path.basename(os.path.normpath(self.path))

    def tokenizer(self):
        """The SentencePiece tokenizer the model was trained with (run config data.tokenizer_model, the built-in
        corpus' tokenizer, or tokenizer.model next to the weights)."""
        if not self.tokenizer_model or not os.path.isfile(self.tokenizer_model):
            raise UserError(f"{self.path}: its tokenizer ({self.tokenizer_model or 'none recorded'}) is not there; "
                            "prepare the data again (megahybrid data builtin) or copy tokenizer.model beside the "
                            "weights")
        return SentencePieceTokenizer(self.tokenizer_model)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_precision(device: torch.device) -> str:
    return "bf16" if device.type == "cuda" else "fp32"


def load(path: str, precision: str | None = None, max_length: int | None = None) -> Loaded:
    """Read the full weights at `path` and copy them into a freshly built (uninitialized) model. `max_length`
    (the longest sequence to be run) only sets what the model is built for; no weight depends on it."""
    if not os.path.exists(path):
        raise UserError(f"--checkpoint {path} does not exist: give a training checkpoint directory (or one of its "
                        "step directories), a consolidated or a Hugging Face directory")
    weights = sources.read(path)
    device = default_device()
    cfg = weights.model
    build_cfg = cfg.replace(seq_length=max(cfg.seq_length, max_length or 0))
    ensure_local_groups()
    model = build_model(build_cfg, ParallelLayout(), precision or default_precision(device), initialize=False)
    sources.check_shapes(weights.tensors, model, cfg, f"{weights.kind} weights at {path}")
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(weights.tensors[name])
    return Loaded(model.to(device).eval(), cfg, path, _step_of(path), weights.tokenizer_model, device)


def fresh(cfg, seed: int = 0, precision: str = "fp32") -> Loaded:
    """A freshly initialized model of `cfg` (tests, and the MQAR training option)."""
    ensure_local_groups()
    torch.manual_seed(seed)
    model = build_model(cfg, ParallelLayout(), precision)
    return Loaded(model.to(default_device()).eval(), cfg, f"fresh-{cfg.pattern}", 0, None, default_device())


def _step_of(path: str) -> int | None:
    for candidate in (path, os.path.join(path, _latest(path))):
        state = os.path.join(candidate, "trainer_state.json")
        if os.path.isfile(state):
            with open(state) as f:
                return json.load(f).get("step")
    return None


def _latest(path: str) -> str:
    latest = os.path.join(path, "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            return f.read().strip()
    return ""
