"""Input checks shared by the NAtS-L ops: value checks cached by tensor version."""
import weakref

import torch

_CHECKED: dict[tuple[int, str], tuple[weakref.ref, int]] = {}


def check_keep_values(keep: torch.Tensor, op: str) -> None:
    """keep must hold only 0 and 1 (any other value would scale a chunk's write or its keys)."""
    _check_once(keep, "keep", lambda t: ((t != 0) & (t != 1)).any(),
                f"{op}: keep must hold only 0 and 1 (a hard selection); threshold or round it in the layer")


def check_log_decay(g: torch.Tensor, op: str) -> None:
    """g is a log decay: a positive entry would grow the state."""
    _check_once(g, "g", lambda t: (t > 0).any(),
                f"{op}: g must be <= 0 (a log decay); compute it as -exp(A_log) * softplus(...) or clamp it")


def _check_once(t: torch.Tensor, name: str, is_bad, message: str) -> None:
    """Reading a GPU tensor's values syncs the host; a tensor already checked (the same live object, unchanged in
    place since: same version counter) is not read again, so a decoding loop or a repeated call pays once."""
    key = (id(t), name)
    seen = _CHECKED.get(key)
    if seen is not None and seen[0]() is t and seen[1] == t._version:
        return
    if bool(is_bad(t.detach())):
        raise ValueError(message)
    if len(_CHECKED) > 256:
        _CHECKED.clear()
    _CHECKED[key] = (weakref.ref(t), t._version)
