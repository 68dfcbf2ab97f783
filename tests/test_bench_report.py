"""The GPU benchmark's reporting (benchmarks/bench_gpu.py), which runs without a GPU: its tables, the outputs it
writes after every row, and the switch that keeps FLA's rows FLA's own kernels."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_gpu  # noqa: E402

META = {"date": "2026-12-02 03:16", "gpu": "NVIDIA H200", "torch": "2.11.0", "cuda": "13.0", "gated_delta": "0.1.0",
        "command": "python3 benchmarks/bench_gpu.py", "flash_qla": "0.1.3"}


def timing(fwd_dev, fb_dev, fwd=None, fb=None, peak=0.5):
    return {"fwd_dev_ms": fwd_dev, "fwdbwd_dev_ms": fb_dev, "fwd_ms": fwd or fwd_dev * 1.1,
            "fwdbwd_ms": fb or fb_dev * 1.1, "peak_extra_gib": peak}


def rows():
    return [
        {"B": 1, "T": 32768, "H": 2, "HV": 8, "ours": timing(0.181, 0.935), "qla": timing(0.238, 0.797),
         "fla": timing(0.927, 3.659)},
        {"B": 1, "T": 8192, "H": 4, "HV": 8, "ours": timing(0.067, 0.325), "qla": timing(0.117, 0.333)},
    ]


def table_rows(md):
    return [line for line in md.splitlines() if line.startswith("| 1 x ")]


def test_report_ratios_and_dashes():
    md = bench_gpu.report(META, "a note", rows(), {}, {})
    assert "Note: a note." in md
    header = next(line for line in md.splitlines() if line.startswith("| B x T | H | HV | pass |"))
    assert "ours / FlashQLA (device)" in header and "ours / FLA (device)" in header
    fwd_28, fb_28, fwd_48, fb_48 = table_rows(md)[:4]
    cells = [c.strip() for c in fwd_28.split("|")[1:-1]]
    # B x T, H, HV, pass, 3 x (device, eager), ratio to FlashQLA, ratio to FLA
    assert cells[3] == "fwd" and cells[4] == "0.181" and cells[6] == "0.238" and cells[8] == "0.927"
    assert cells[10] == f"{0.181 / 0.238:.2f}" and cells[11] == f"{0.181 / 0.927:.2f}"
    cells = [c.strip() for c in fb_48.split("|")[1:-1]]
    assert cells[3] == "fwd+bwd" and cells[8] == "-" and cells[9] == "-"  # FLA not measured on this row
    assert cells[10] == f"{0.325 / 0.333:.2f}" and cells[11] == "-"


def test_outputs_written_as_rows_arrive(tmp_path):
    out = str(tmp_path)
    bench_gpu.write_outputs(out, META, None, rows()[:1], {}, {})
    first = json.load(open(os.path.join(out, "bench_gpu.json")))
    assert len(first["results"]) == 1
    bench_gpu.write_outputs(out, META, None, rows(), {}, {})
    data = json.load(open(os.path.join(out, "bench_gpu.json")))
    assert [(r["T"], r["H"]) for r in data["results"]] == [(32768, 2), (8192, 4)]
    assert data["meta"]["gpu"] == "NVIDIA H200"
    md = open(os.path.join(out, "bench_gpu.md")).read()
    assert len(table_rows(md)) == 4 + 2  # two passes per row, then the peak-memory table
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert os.path.getsize(os.path.join(out, "bench_gpu.png")) > 0


def test_fla_backend_dispatch_turned_off(monkeypatch):
    # FLA 0.6 hands its calls to FlashQLA when that is importable; the benchmark must time FLA's own kernels
    monkeypatch.delenv("FLA_DISABLE_BACKEND_DISPATCH", raising=False)
    monkeypatch.delenv("FLA_FLASH_QLA", raising=False)
    if "fla" in sys.modules:
        pytest.skip("FLA already imported in this process")
    bench_gpu.load_fla()  # (FLA need not be installed: the switch is set before the import is tried)
    assert os.environ["FLA_DISABLE_BACKEND_DISPATCH"] == "1"
    assert os.environ["FLA_FLASH_QLA"] == "0"


def test_plot_from_merges_runs_by_shape(tmp_path):
    # three runs: the first file's figures win for an implementation measured twice; rows follow DEFAULT_ROWS
    def dump(name, results):
        path = tmp_path / name
        path.write_text(json.dumps({"meta": META, "results": results}))
        return str(path)

    row48 = {"B": 1, "T": 8192, "H": 4, "HV": 8}
    row28 = {"B": 1, "T": 32768, "H": 2, "HV": 8}
    a = dump("a.json", [dict(row48, ours=timing(0.067, 0.325), qla=timing(0.117, 0.333))])
    b = dump("b.json", [dict(row48, ours=timing(0.070, 0.330)),
                        dict(row28, ours=timing(0.181, 0.935), qla=timing(0.238, 0.797))])
    c = dump("c.json", [dict(row28, ours=timing(0.179, 0.939), fla=timing(0.927, 3.659)),
                        {"B": 3, "T": 100, "H": 1, "HV": 1, "ours": timing(0.01, 0.02)}])
    rows, gpu = bench_gpu.merge_results([a, b, c])
    assert gpu == "NVIDIA H200"
    assert [(r["B"], r["T"], r["H"], r["HV"]) for r in rows] == [(1, 32768, 2, 8), (1, 8192, 4, 8), (3, 100, 1, 1)]
    r28, r48, _ = rows
    assert r28["ours"]["fwd_dev_ms"] == 0.181 and r28["qla"]["fwd_dev_ms"] == 0.238
    assert r28["fla"]["fwd_dev_ms"] == 0.927
    assert r48["ours"]["fwd_dev_ms"] == 0.067 and r48["qla"]["fwdbwd_dev_ms"] == 0.333 and "fla" not in r48


def test_busy_time_counts_overlapping_kernels_once():
    # one stream: the sum of the durations; two kernels at once: their union
    assert bench_gpu.busy_us([(0.0, 2.0), (2.0, 5.0), (7.0, 8.0)]) == 6.0
    assert bench_gpu.busy_us([(0.0, 4.0), (1.0, 3.0), (2.0, 6.0), (10.0, 11.0)]) == 7.0
    assert bench_gpu.busy_us([]) == 0.0
