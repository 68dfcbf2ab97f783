"""python -m gated_delta.checklist [--device cpu|cuda] [--quick] [--soak-steps N] [--only NAME[,NAME]] [--out DIR]"""
import argparse
import datetime
import os
import platform
import sys
import time
import traceback

import torch

import gated_delta

from . import CHECKS, FAIL, Config, Result


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m gated_delta.checklist", description=__doc__)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="small sizes, for CI")
    parser.add_argument("--soak-steps", type=int, default=None, help="steps of the soak run")
    parser.add_argument("--only", default="", help=f"comma-separated checks among {', '.join(CHECKS)}")
    parser.add_argument("--out", default="checklist_out", help="folder of the markdown report and its plots")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(CHECKS)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        parser.error(f"unknown check(s) {', '.join(unknown)}; choose among {', '.join(CHECKS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    if args.soak_steps is not None and args.soak_steps < 1:
        parser.error("--soak-steps must be >= 1")
    return args, names


def environment() -> str:
    lines = [f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
             f"- gated_delta {gated_delta.__version__}, torch {torch.__version__}, Python {platform.python_version()}",
             f"- host: {platform.node()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads"]
    if torch.cuda.is_available():
        lines.append(f"- CUDA {torch.version.cuda}: " + ", ".join(
            torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())))
    return "\n".join(lines) + "\n"


def write_report(cfg: Config, results, argv) -> str:
    os.makedirs(cfg.out, exist_ok=True)
    path = os.path.join(cfg.out, "report.md")
    parts = ["# gated_delta production checklist\n\n",
             f"`python -m gated_delta.checklist {' '.join(argv)}` on {cfg.device}"
             f"{' (quick)' if cfg.quick else ''}\n\n", environment(), "\n## Summary\n\n```\n",
             "".join(r.line() + "\n" for r in results), "```\n"]
    for r in results:
        parts.append(f"\n## {r.name}: {r.status}\n\n{r.summary}\n\n{r.details}\n")
        parts += [f"![{r.name}]({p})\n" for p in r.plots]
    with open(path, "w") as f:
        f.write("".join(parts))
    return path


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, names = parse_args(argv)
    cfg = Config(device=args.device, quick=args.quick, out=args.out, soak_steps=args.soak_steps)
    results = []
    for name in names:
        start = time.perf_counter()
        try:
            result = CHECKS[name](cfg)
        except Exception as err:  # noqa: BLE001 -- a check that raises fails, and the others still run
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            result = Result(name, FAIL, f"raised {type(err).__name__}: {first[:300]}",
                            "```\n" + traceback.format_exc() + "```\n")
        result.seconds = time.perf_counter() - start
        results.append(result)
        print(result.line(), flush=True)
    path = write_report(cfg, results, argv)
    print(f"report: {path}")
    return 1 if any(r.status == FAIL for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
