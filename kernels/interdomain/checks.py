"""Input checks of the Interdomain ops: one-line ValueErrors naming the fix, and the decay check that does not sync
the GPU on every call (a tensor already checked is re-checked asynchronously)."""
import weakref

import torch

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CHECKED_DECAY: dict = {}


def check_inputs(q, k, v, decay, b, initial_state, normalize, chunk_size, readout=None, values=True):
    """One-line ValueErrors naming the fix for every malformed input. values=False leaves out the check of decay's
    values (check_decay), which reads the tensor: the compiled path runs it inside the op."""
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [B, T, H, K]; got {tuple(q.shape)} and {tuple(k.shape)}")
    B, T, H, K = q.shape
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B, T, H, V] with q's B, T, H = {B, T, H}; got {tuple(v.shape)}")
    if T == 0 or B == 0:
        raise ValueError("q must have at least one batch row and one token (B, T > 0)")
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype among fp32/bf16/fp16; got {q.dtype}, {k.dtype}, {v.dtype}")
    if K > 256 or v.shape[-1] > 256:
        raise ValueError(f"head dims K, V must be <= 256; got K={K}, V={v.shape[-1]}")
    for name, p in (("decay", decay), ("b", b)):
        if p.dim() != 3 or p.shape[0] != H or p.shape[2] != 2 or p.dtype != torch.float32:
            raise ValueError(f"{name} must be fp32 [H={H}, M, 2]; got {p.dtype} {tuple(p.shape)}")
    M = decay.shape[1]
    if b.shape[1] != M or not 1 <= M <= 64:
        raise ValueError(f"decay and b must share M with 1 <= M <= 64; got {decay.shape[1]} and {b.shape[1]}")
    if readout is not None and (readout.shape != (H, M, M, 2) or readout.dtype != torch.float32):
        raise ValueError(f"readout must be fp32 [H={H}, M={M}, M, 2] (re, im) or None; got {readout.dtype} "
                         f"{tuple(readout.shape)}")
    tensors = [q, k, v, decay, b] + list(initial_state or ()) + ([readout] if readout is not None else [])
    if any(t.device != q.device for t in tensors):
        raise ValueError("all inputs (q, k, v, decay, b, initial_state, readout) must be on one device; move them "
                         "with .to()")
    if chunk_size not in (16, 32, 64, 128):
        raise ValueError(f"chunk_size must be 16, 32, 64 or 128; got {chunk_size}")
    if values:
        check_decay(decay)
    if initial_state is not None:
        _check_state(initial_state, B, H, M, K, v.shape[-1], normalize)


def check_decay(decay):
    """log|lambda| <= 0 on every call. A CPU tensor is read each time (no sync to save; writes through `decay.data`
    bump no version counter, so no cache can see them). On the GPU reading syncs, so a tensor already checked (the
    same live object, same version counter) is not read on the host again: instead its max goes to pinned host
    memory asynchronously, and a later call raises once that copy has landed (`_poll_async_check`)."""
    if decay.device.type != "cuda":
        _refuse_growing(bool((decay[..., 0] > 0).any()))
        return
    if torch.cuda.is_current_stream_capturing():
        return  # nothing can be read while a CUDA graph is captured: its warm-up calls were checked
    _poll_async_check()
    seen = _CHECKED_DECAY.get(id(decay))
    if seen is not None and seen[0]() is decay and seen[1] == decay._version:
        _start_async_check(decay)
        return
    _refuse_growing(bool((decay[..., 0] > 0).any()))
    if len(_CHECKED_DECAY) > 64:
        _CHECKED_DECAY.clear()
    _CHECKED_DECAY[id(decay)] = (weakref.ref(decay), decay._version)


def _refuse_growing(growing, late=""):
    if growing:
        raise ValueError(f"decay[..., 0] = log|lambda| must be <= 0 (a growing mode){late}; clamp it in the layer")


# one device-side decay check in flight at a time: (event, pinned host max); a call finding it unfinished skips its
# own, so a decode loop adds one small reduction and copy per check and never waits
_ASYNC_CHECK: dict = {}


def _start_async_check(decay):
    if _ASYNC_CHECK:
        return
    host = torch.empty((), dtype=torch.float32, pin_memory=True)
    host.copy_(decay[..., 0].amax(), non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    _ASYNC_CHECK.update(event=event, host=host)


def _poll_async_check():
    if _ASYNC_CHECK and _ASYNC_CHECK["event"].query():
        growing = bool(_ASYNC_CHECK.pop("host") > 0)
        _ASYNC_CHECK.clear()
        _refuse_growing(growing, " (found after a checked call: decay was written in place, e.g. through .data)")


def _check_state(state, B, H, M, K, V, normalize):
    want = [(B, H, M, 2, K), (B, H, M, 2, V)] + ([(B, H, M, 2)] if normalize else [])
    if len(state) != len(want):
        raise ValueError(f"initial_state must be a tuple of {len(want)} tensors (U, G{', eta' if normalize else ''})")
    for t, shape in zip(state, want):
        if tuple(t.shape) != shape or t.dtype != torch.float32:
            raise ValueError(f"initial_state tensors must be fp32 {want}; got {t.dtype} {tuple(t.shape)}")
