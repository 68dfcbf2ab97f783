"""The production checklist of gated_delta: `python -m gated_delta.checklist --help`.

Each check takes a Config and returns a Result (PASS, FAIL or SKIP with its figures on one line, markdown details
and plots for the report)."""
from .common import FAIL, PASS, SKIP, Config, Result
from .perf import check_batch, check_seqlen

CHECKS = {
    "seqlen": check_seqlen,
    "batch": check_batch,
}

__all__ = ["CHECKS", "Config", "Result", "PASS", "FAIL", "SKIP"]
