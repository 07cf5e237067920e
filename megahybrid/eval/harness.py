"""An lm-evaluation-harness model over a megahybrid checkpoint (`pip install 'megahybrid[eval]'`), and
`megahybrid eval harness --checkpoint PATH --tasks piqa,hellaswag`.

`MegahybridLM` answers the harness' three request kinds from plain (context, continuation) / (text,) /
(context, gen_kwargs) tuples, so it works without lm-eval installed; `harness_model()` adds lm-eval's `LM` base
class and registers it as model "megahybrid" (then `lm_eval --model megahybrid --model_args checkpoint=PATH`
also works from Python, after `import megahybrid.eval.harness` and `register()`).
"""
import json
import os
import time

import torch

from megahybrid.errors import UserError
from megahybrid.eval.generate import Sampling, sample
from megahybrid.eval.loading import load
from megahybrid.model.decode import full_logits


def _args(request):
    return request.args if hasattr(request, "args") else request


class MegahybridLM:
    def __init__(self, checkpoint: str | None = None, loaded=None, tokenizer=None, max_length: int | None = None,
                 precision: str | None = None, **_ignored):
        super().__init__()
        if loaded is None:
            loaded = load(checkpoint, precision, max_length=max_length)
        self.loaded = loaded
        self.tok = tokenizer or loaded.tokenizer()
        self.max_length = int(max_length or loaded.cfg.seq_length)

    def _encode(self, text: str) -> list[int]:
        return self.tok.encode(text) if text else []

    @torch.no_grad()
    def _continuation_logprob(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """log p(continuation | EOD + context), left-truncated to max_length; and whether it is the argmax."""
        if not continuation:
            return 0.0, True
        ids = ([self.tok.eod] + context + continuation)[-(self.max_length + 1):]
        x = torch.tensor([ids[:-1]], device=self.loaded.device)
        logprobs = torch.log_softmax(full_logits(self.loaded.model, x)[0, -len(continuation):], -1)
        target = torch.tensor(continuation, device=logprobs.device)
        picked = logprobs.gather(-1, target[:, None])[:, 0]
        return picked.sum().item(), bool((logprobs.argmax(-1) == target).all())

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        out = []
        for request in requests:
            context, continuation = _args(request)
            out.append(self._continuation_logprob(self._encode(context), self._encode(continuation)))
        return out

    def loglikelihood_rolling(self, requests) -> list[float]:
        """Whole-text log-likelihood, in disjoint windows of max_length tokens (each window's context is the
        end of the previous one, up to max_length tokens)."""
        out = []
        for request in requests:
            ids, total = self._encode(_args(request)[0]), 0.0
            for start in range(0, len(ids), self.max_length):
                total += self._continuation_logprob(ids[max(0, start - self.max_length):start],
                                                    ids[start:start + self.max_length])[0]
            out.append(total)
        return out

    def generate_until(self, requests) -> list[str]:
        out = []
        for request in requests:
            context, kwargs = _args(request)
            out.append(self._generate(context, dict(kwargs or {})))
        return out

    def _generate(self, context: str, kwargs: dict) -> str:
        until = kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        new = max(1, min(int(kwargs.get("max_gen_toks", 256)), self.max_length - 1))
        ids = ([self.tok.eod] + self._encode(context))[-(self.max_length - new):]
        temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample", False) else 0.0
        sampling = Sampling(new, temperature, float(kwargs.get("top_p", 1.0)), int(kwargs.get("seed", 0)))
        tokens, _ = sample(self.loaded.model, torch.tensor([ids], device=self.loaded.device), sampling, self.tok.eod)
        generated = [t for t in tokens[0, len(ids):].tolist() if t != self.tok.eod]
        text = self.tok.decode(generated)
        for stop in until:
            text = text.split(stop)[0] if stop else text
        return text


def harness_model(**kwargs):
    """A MegahybridLM that is also an lm-eval `LM` (registered as "megahybrid")."""
    return register()(**kwargs)


def register():
    try:
        from lm_eval.api.model import LM
        from lm_eval.api.registry import register_model
    except ImportError:
        raise UserError("lm-evaluation-harness is not installed: pip install 'megahybrid[eval]' (or lm-eval)") from None
    try:
        return register_model("megahybrid")(type("MegahybridHarnessLM", (MegahybridLM, LM), {}))
    except AssertionError:  # already registered in this process
        from lm_eval.api.registry import get_model

        return get_model("megahybrid")


def run(args) -> int:
    """Run lm-eval tasks on the checkpoint and write the harness' results JSON."""
    model_class = register()  # lm-eval is optional: register() says how to install it before this import
    import lm_eval
    from lm_eval.tasks import TaskManager

    model = model_class(checkpoint=args.checkpoint, max_length=args.max_length, precision=args.precision)
    manager = TaskManager(include_path=args.include_path) if args.include_path else TaskManager()
    results = lm_eval.simple_evaluate(model=model, tasks=args.tasks.split(","), num_fewshot=args.num_fewshot,
                                      limit=args.limit, task_manager=manager)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"harness-{time.strftime('%Y-%m-%d')}.json")
    with open(path, "w") as f:
        json.dump({"checkpoint": args.checkpoint, "results": results["results"]}, f, indent=1, default=str)
    for task, metrics in results["results"].items():
        print(task, {k: v for k, v in metrics.items() if isinstance(v, float)}, flush=True)
    print(f"wrote {path}", flush=True)
    return 0
