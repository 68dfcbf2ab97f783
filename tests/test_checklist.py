"""The production checklist in its CPU-sized form: `python -m gated_delta.checklist --quick --device cpu`."""
import os
import re
import subprocess
import sys

import gated_delta

# The checks README.md documents.
CHECKS = ("seqlen", "batch", "grads", "ddp", "amp", "allocator", "soak", "determinism")


def checklist(cwd, *args, timeout=600):
    """Runs `python -m gated_delta.checklist ARGS` in cwd with this process's gated_delta."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(gated_delta.__file__))] + sys.path))
    return subprocess.run([sys.executable, "-m", "gated_delta.checklist", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_quick_checklist_on_the_cpu(tmp_path):
    out = tmp_path / "report"
    run = checklist(tmp_path, "--quick", "--device", "cpu", "--out", str(out))
    assert run.returncode == 0, run.stdout + run.stderr
    lines = {m.group(2): m.group(1) for m in re.finditer(r"^(PASS|FAIL|SKIP) (\w+) ", run.stdout, re.MULTILINE)}
    assert set(lines) == set(CHECKS), run.stdout
    # The multi-process check is a real 2-process gloo run.
    assert lines["ddp"] == "PASS", run.stdout
    report = (out / "report.md").read_text()
    for name in CHECKS:
        assert re.search(rf"^(PASS|SKIP) {name} ", report, re.MULTILINE), name
        assert f"## {name}: " in report
    for plot in re.findall(r"!\[\w+\]\((\S+)\)", report):
        assert (out / plot).stat().st_size > 0, plot


def test_only_and_unknown_check(tmp_path):
    run = checklist(tmp_path, "--device", "cpu", "--only", "nope", timeout=120)
    assert run.returncode == 2 and "unknown check(s) nope" in run.stderr


def test_ddp_spawn_deadline_ends_workers():
    # A worker that outlives the deadline is ended and reported, instead of hanging the check: worker i sleeps
    # i seconds (time.sleep(i)), so worker 1 outlives a 0.3 s deadline and fits in a 30 s one.
    import time

    import pytest

    from gated_delta.checklist.common import spawn_with_deadline

    start = time.monotonic()
    with pytest.raises(TimeoutError, match="2 workers did not all finish within 0.3 s"):
        spawn_with_deadline(time.sleep, (), 2, 0.3)
    assert time.monotonic() - start < 20
    spawn_with_deadline(time.sleep, (), 2, 30)
