"""Where a kernel's warps stall, by region of its SASS: the source page of an Nsight Compute report, cut at its
synchronisation points.

    ncu --set full --import-source yes -k regex:NAME --launch-count 1 -o REPORT python3 ...
    ncu --import REPORT.ncu-rep --page source --csv --print-source sass > sass.csv
    python3 tools/ncu_regions.py sass.csv [--top 10] [--cuts 3005,3739,...] [--min-share 0.5]

The SASS is cut before every `USETMAXREG` (where a warp-specialised kernel's roles begin), named barrier, mbarrier
wait, `WARPGROUP.DEPBAR` (the wait for a warpgroup product) and `EXIT`, or at the instruction indices given with
--cuts. For each region: its first instruction, the warp stall samples in it (and their share of the kernel's),
the warp instructions it executed, and its three main stall reasons; then, for each role (the code from one
`USETMAXREG` to the next), the same totals. --top lists the instructions with the most samples. The samples of a
warp waiting at a barrier fall on the instruction after it, so they count in the region that the barrier opens.
"""
import argparse
import csv
import sys

MARKERS = ("USETMAXREG", "BAR.SYNC", "BAR.ARV", "BAR.RED", "SYNCS.PHASECHK", "WARPGROUP.DEPBAR", "EXIT")


def load(path):
    """The rows of the first kernel in the export: (index, sass, samples, executed, {stall: samples})."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    start = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    hdr = rows[start]
    col = {h: i for i, h in enumerate(hdr)}
    samples = col["Warp Stall Sampling (All Samples)"]
    executed = col.get("Instructions Executed")
    stalls = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    out = []
    for r in rows[start + 1:]:
        if not r or r[0] in ("Kernel Name", "Address"):
            break
        num = lambda i: int(r[i]) if i is not None and r[i].strip().lstrip("-").isdigit() else 0  # noqa: E731
        out.append((len(out), r[col["Source"]].strip(), num(samples), num(executed),
                    {s[len("stall_"):]: num(col[s]) for s in stalls}))
    return out


def summary(name, part, total):
    s = sum(x[2] for x in part)
    e = sum(x[3] for x in part)
    agg = {}
    for x in part:
        for k, v in x[4].items():
            agg[k] = agg.get(k, 0) + v
    main = ", ".join(f"{k} {v}" for k, v in sorted(agg.items(), key=lambda kv: -kv[1])[:3] if v)
    return s, f"{name:<48.48} {s:>8d} {100.0 * s / max(total, 1):5.1f}% {e:>12d}  {main}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--cuts", default="", help="instruction indices to cut at, instead of the markers")
    ap.add_argument("--top", type=int, default=0, help="list the instructions with the most samples")
    ap.add_argument("--min-share", type=float, default=0.0, help="print regions with at least this share (%%)")
    a = ap.parse_args()
    ins = load(a.csv)
    if not ins:
        sys.exit(f"{a.csv}: no SASS rows")
    total = sum(x[2] for x in ins)
    if a.cuts:
        cuts = sorted({0, *(int(c) for c in a.cuts.split(",")), len(ins)})
    else:
        cuts = sorted({0, len(ins), *(x[0] for x in ins if any(m in x[1] for m in MARKERS))})
    print(f"{len(ins)} instructions, {total} stall samples")
    print(f"{'region (first instruction)':<48} {'samples':>8} {'share':>6} {'warp instr':>12}  main stalls")
    for lo, hi in zip(cuts, cuts[1:]):
        s, line = summary(f"{lo}-{hi} {ins[lo][1]}", ins[lo:hi], total)
        if 100.0 * s / max(total, 1) >= a.min_share:
            print(line)
    roles = [x[0] for x in ins if "USETMAXREG" in x[1]]
    if roles:
        print("\nroles (from one USETMAXREG to the next)")
        bounds = [0, *roles, len(ins)]
        for lo, hi in zip(bounds, bounds[1:]):
            print(summary(f"{lo}-{hi} {ins[lo][1]}", ins[lo:hi], total)[1])
    if a.top:
        print(f"\ntop {a.top} instructions")
        for x in sorted(ins, key=lambda x: -x[2])[:a.top]:
            main = ", ".join(f"{k} {v}" for k, v in sorted(x[4].items(), key=lambda kv: -kv[1])[:2] if v)
            print(f"{x[0]:>6d} {x[2]:>7d}  {x[1][:60]:<60}  {main}")


if __name__ == "__main__":
    main()
