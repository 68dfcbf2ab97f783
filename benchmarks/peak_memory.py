"""Peak extra memory of one forward+backward of gated_delta_rule on the GPU, per row (bf16, K = V = 128).

    python3 benchmarks/peak_memory.py --rows 8x4096:16:32,4x8192:16:64     (from the repository root)

Measured as bench_gpu.py measures it, without the timing: three warm-up calls, then `max_memory_allocated` during
one forward+backward (`o.backward(do)`, the input gradients cleared first) minus what was allocated before it; also
the caching allocator's largest reserved size so far. Which build runs is the one `gated_delta` imports from, so two
builds compare with PYTHONPATH.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_gpu as bg  # noqa: E402
import gated_delta  # noqa: E402
from gated_delta import gated_delta_rule  # noqa: E402


def peak_row(B, T, H, HV):
    xs, do = bg.make(B, T, H, HV, seed=100, requires_grad=True)

    def fb():
        for x in xs:
            x.grad = None
        gated_delta_rule(*xs, scale=bg.K ** -0.5)[0].backward(do)

    for _ in range(3):
        fb()
    for x in xs:
        x.grad = None
    return bg.peak_extra_bytes(fb), torch.cuda.max_memory_reserved()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", required=True, help="comma-separated BxT:H:HV, e.g. 8x4096:16:32")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("peak_memory.py needs a CUDA GPU")
    print("gated_delta from", os.path.dirname(gated_delta.__file__))
    for r in args.rows.split(","):
        bt, h, hv = r.split(":")
        B, T = (int(x) for x in bt.split("x"))
        peak, reserved = peak_row(B, T, int(h), int(hv))
        print(f"{r}: peak extra {peak / 2**30:.3f} GiB  (reserved {reserved / 2**30:.3f} GiB)", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
