"""The production checklist of gated_delta: `python -m gated_delta.checklist --help`.

Each check takes a Config and returns a Result (PASS, FAIL or SKIP with its figures on one line, markdown details
and plots for the report)."""
from .common import FAIL, PASS, SKIP, Config, Result
from .numerics import check_amp, check_determinism, check_grads
from .perf import check_batch, check_seqlen
from .training import check_allocator, check_ddp, check_soak

CHECKS = {
    "seqlen": check_seqlen,
    "batch": check_batch,
    "grads": check_grads,
    "ddp": check_ddp,
    "amp": check_amp,
    "allocator": check_allocator,
    "soak": check_soak,
    "determinism": check_determinism,
}

__all__ = ["CHECKS", "Config", "Result", "PASS", "FAIL", "SKIP"]
