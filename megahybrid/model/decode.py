"""Incremental decoding through megatron-core's static inference context, for every mixer.

The model is megatron's GPTModel; `inference_context` (a `StaticInferenceContext`) travels to every layer's
mixer, which keeps its decode cache in `inference_context.key_value_memory_dict[layer_number]` (softmax: the
KV cache megatron's SelfAttention manages; recurrent mixers: their fixed-size state) and reads the position
from `sequence_len_offset`. A prefill call carries several tokens, a decode call one; the caller advances
`sequence_len_offset` after each call. Logits come back for every position the call carried, over the full vocabulary (we switch off megatron's
last-token-only materialization) so tests can compare them with the full forward.
"""
import torch
from megatron.core.inference.contexts import StaticInferenceContext


def new_context(batch_size: int, max_length: int) -> StaticInferenceContext:
    ctx = StaticInferenceContext(max_batch_size=batch_size, max_sequence_length=max_length)
    ctx.materialize_only_last_token_logits = False
    return ctx


@torch.no_grad()
def step_logits(model, tokens: torch.Tensor, ctx: StaticInferenceContext) -> torch.Tensor:
    """Feed `tokens` [B, n] at positions ctx.sequence_len_offset.. and return fp32 logits [B, n, vocab]."""
    offset = ctx.sequence_len_offset
    if offset + tokens.shape[1] > ctx.max_sequence_length:
        raise ValueError(f"decoding past the context's max_sequence_length={ctx.max_sequence_length}; start a "
                         "longer context")
    positions = torch.arange(offset, offset + tokens.shape[1], device=tokens.device).expand_as(tokens)
    if offset > 0:
        ctx.enable_decode_mode() if tokens.shape[1] == 1 else ctx.enable_prefill_mode()
    logits = model(input_ids=tokens, position_ids=positions, attention_mask=None, inference_context=ctx,
                   runtime_gather_output=True)
    ctx.sequence_len_offset += tokens.shape[1]
    return logits.float()


@torch.no_grad()
def full_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of one ordinary forward over the whole sequence, [B, T, vocab] fp32."""
    return model(input_ids=tokens, position_ids=None, attention_mask=None, runtime_gather_output=True).float()


@torch.no_grad()
def prefill_then_decode(model, tokens: torch.Tensor, prefill: int, chunk: int | None = None) -> torch.Tensor:
    """Logits [B, T, vocab] computed by a prefill of the first `prefill` tokens (in pieces of `chunk` tokens, or
    one piece), then one token at a time: equal to `full_logits` when every mixer's cache is right."""
    B, T = tokens.shape
    ctx = new_context(B, T)
    pieces = []
    step = chunk or max(prefill, 1)
    for start in range(0, prefill, step):
        pieces.append(step_logits(model, tokens[:, start:min(prefill, start + step)], ctx))
    for t in range(prefill, T):
        pieces.append(step_logits(model, tokens[:, t:t + 1], ctx))
    return torch.cat(pieces, 1)


def greedy_decode_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """Token-by-token logits for a prompt (no prefill): the strictest check of a decode cache."""
    return prefill_then_decode(model, tokens, prefill=0)


@torch.no_grad()
def generate_greedy(model, prompt: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """Greedy continuation of `prompt` [B, T0]: one prefill call, then one decode call per new token."""
    B, T0 = prompt.shape
    ctx = new_context(B, T0 + max_new_tokens)
    logits = step_logits(model, prompt, ctx)
    out = [prompt]
    for i in range(max_new_tokens):
        out.append(logits[:, -1].argmax(-1, keepdim=True))
        if i + 1 < max_new_tokens:
            logits = step_logits(model, out[-1], ctx)
    return torch.cat(out, 1)
