"""Incremental decoding (megahybrid.model.decode) equals the full forward, for every mixer pattern in PATTERNS
(a new mixer with a decode cache joins with one line)."""
import pytest

from tests.dist import run_on_ranks
from tests.utils import assert_close

LOGIT_TOL = 1e-5  # fp32, relative RMS over all logits

PATTERNS = [
    "S",
    "NG", "GNS",
    "ID",
]


def _decode_checks(rank, world, patterns):
    import torch

    from megahybrid.distributed import init_distributed, shutdown
    from megahybrid.model import decode
    from megahybrid.model.config import preset
    from megahybrid.model.gpt import build_model
    from megahybrid.parallel import ParallelLayout

    out = {}
    for pattern in patterns:
        cfg = preset("tiny", pattern=pattern, num_layers=max(2, len(pattern)), seq_length=192)
        init_distributed(ParallelLayout(), seed=7)
        model = build_model(cfg, ParallelLayout()).eval()
        tokens = torch.randint(0, cfg.vocab_size, (2, 150), generator=torch.Generator().manual_seed(3))
        full = decode.full_logits(model, tokens)
        out[pattern] = {
            "token_by_token": (decode.greedy_decode_logits(model, tokens[:, :70]), full[:, :70]),
            "prefill_70_then_decode": (decode.prefill_then_decode(model, tokens, prefill=70), full),
            "chunked_prefill_64": (decode.prefill_then_decode(model, tokens, prefill=140, chunk=64), full),
        }
        prompt = tokens[:, :9]
        greedy = decode.generate_greedy(model, prompt, 6)
        reference = prompt
        for _ in range(6):
            reference = torch.cat([reference, decode.full_logits(model, reference)[:, -1:].argmax(-1)], 1)
        out[pattern]["generate"] = (greedy.float(), reference.float())
    shutdown()
    return out


@pytest.mark.dist
def test_incremental_decoding_matches_full_forward():
    # The ops' torch CPU paths, as a user's CPU run takes: the caches are what this checks, and each kernel's
    # initial-state and step paths are checked against its fp32 definition in tests/kernels (interpreted, every
    # step here took ~2 s and the test over 4 minutes on the 2-core CI machine)
    results = run_on_ranks(_decode_checks, 1, PATTERNS, env={"TRITON_INTERPRET": "0"})[0]
    for pattern, checks in results.items():
        for name, (got, want) in checks.items():
            if name == "generate":
                assert got.equal(want), f"{pattern} greedy generation {got} != full-forward greedy {want}"
            else:
                assert_close(got, want, LOGIT_TOL, f"{pattern} {name}")
