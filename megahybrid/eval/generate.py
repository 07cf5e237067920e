"""`megahybrid generate`: sampling (temperature, top-p) through the decode caches of megahybrid.model.decode:
one prefill call for the prompt, then one decode call per new token. Temperature 0 is greedy decoding."""
import sys
import time
from dataclasses import dataclass

import torch

from megahybrid.errors import UserError
from megahybrid.eval.loading import load
from megahybrid.model import decode


@dataclass
class Sampling:
    max_new_tokens: int = 64
    temperature: float = 0.8
    top_p: float = 0.95
    seed: int = 0
    stop_at_eos: bool = True

    def check(self) -> None:
        if self.max_new_tokens < 1:
            raise UserError(f"--max-new-tokens {self.max_new_tokens}: give at least 1")
        if self.temperature < 0:
            raise UserError(f"--temperature {self.temperature}: give 0 (greedy) or a positive temperature")
        if not 0 < self.top_p <= 1:
            raise UserError(f"--top-p {self.top_p}: give a probability mass in (0, 1]")


def next_tokens(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> torch.Tensor:
    """[B, V] logits -> [B, 1] token ids: argmax at temperature 0, else nucleus sampling."""
    if sampling.temperature == 0:
        return logits.argmax(-1, keepdim=True)
    probs = torch.softmax(logits.float() / sampling.temperature, -1)
    if sampling.top_p < 1:
        sorted_probs, order = probs.sort(-1, descending=True)
        # Drop a token when the mass before it already reaches top_p; the most likely token always stays.
        drop = sorted_probs.cumsum(-1) - sorted_probs >= sampling.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator)


@torch.no_grad()
def sample(model, prompt: torch.Tensor, sampling: Sampling, eos_id: int | None = None) -> tuple[torch.Tensor, dict]:
    """Continue `prompt` [B, T0]; returns prompt + new tokens [B, T0 + n] and timings. Stops early (B = 1) at
    eos_id when sampling.stop_at_eos."""
    sampling.check()
    B, T0 = prompt.shape
    generator = torch.Generator(device=prompt.device).manual_seed(sampling.seed)
    ctx = decode.new_context(B, T0 + sampling.max_new_tokens)
    ctx.materialize_only_last_token_logits = True  # the prefill's other positions are not needed
    t0 = time.perf_counter()
    logits = decode.step_logits(model, prompt, ctx)[:, -1]
    _sync(prompt.device)
    t1 = time.perf_counter()
    out = [prompt]
    for i in range(sampling.max_new_tokens):
        out.append(next_tokens(logits, sampling, generator))
        if sampling.stop_at_eos and B == 1 and out[-1].item() == eos_id:
            break
        if i + 1 < sampling.max_new_tokens:
            logits = decode.step_logits(model, out[-1], ctx)[:, -1]
    _sync(prompt.device)
    t2 = time.perf_counter()
    new = len(out) - 1
    return torch.cat(out, 1), {"prompt_tokens": T0, "new_tokens": new, "prefill_s": t1 - t0,
                               "decode_s": t2 - t1, "tokens_per_s": B * new / max(t2 - t1, 1e-9)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def prompt_ids(tokenizer, text: str, limit: int, max_new_tokens: int) -> list[int]:
    """EOD, then the prompt's tokens: training documents follow an EOD, so generation starts a document."""
    ids = [tokenizer.eod] + tokenizer.encode(text)
    if len(ids) + max_new_tokens > limit:
        raise UserError(f"the prompt is {len(ids)} tokens and --max-new-tokens {max_new_tokens}, more than the "
                        f"model's {limit}-token limit: shorten the prompt, lower --max-new-tokens or raise "
                        "--max-length (RoPE extends past the training context, quality may drop)")
    return ids


def run(args) -> int:
    sampling = Sampling(args.max_new_tokens, args.temperature, args.top_p, args.seed, not args.ignore_eos)
    sampling.check()
    loaded = load(args.checkpoint, args.precision, max_length=args.max_length)
    tokenizer = loaded.tokenizer()
    limit = args.max_length or loaded.cfg.seq_length
    ids = prompt_ids(tokenizer, args.prompt, limit, sampling.max_new_tokens)
    prompt = torch.tensor([ids], device=loaded.device)
    tokens, stats = sample(loaded.model, prompt, sampling, tokenizer.eod)
    text = [t for t in tokens[0, 1:].tolist()]
    print(tokenizer.decode(text[:-1] if text and text[-1] == tokenizer.eod else text), flush=True)
    print(f"[{stats['new_tokens']} new tokens, {stats['tokens_per_s']:.1f} tok/s decode; prefill of "
          f"{stats['prompt_tokens']} tokens {stats['prefill_s'] * 1e3:.1f} ms]", file=sys.stderr, flush=True)
    return 0
