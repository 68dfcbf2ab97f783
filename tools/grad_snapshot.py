"""Every output and gradient of a few fixed CUDA calls, saved so that two builds can be compared bitwise.

    python3 tools/grad_snapshot.py save A.pt                      # with one build importable
    PYTHONPATH=/other/build/python python3 tools/grad_snapshot.py save B.pt
    python3 tools/grad_snapshot.py compare A.pt B.pt              # exit 1 when any tensor differs

The calls cover bf16 and fp16 inputs, beta in bf16, fp16 and fp32, groups of 1 to 4 value heads per q/k head, K of
64 and 128, V of 64, 128 and 256, varlen and initial states; the inputs come from fixed seeds, so a change that
keeps the arithmetic (its order included) gives identical files.
"""
import argparse
import sys

import torch
import torch.nn.functional as F

# (B, T, H, HV, K, V, input dtype, varlen, initial state, beta dtype)
CASES = [
    (2, 300, 2, 4, 128, 128, torch.bfloat16, False, True, torch.bfloat16),
    (1, 1000, 4, 4, 128, 64, torch.float16, False, False, torch.float32),
    (1, 777, 1, 4, 64, 128, torch.bfloat16, True, True, torch.bfloat16),
    (1, 4096, 2, 8, 128, 128, torch.bfloat16, False, False, torch.bfloat16),
    (1, 513, 2, 6, 128, 256, torch.float16, False, True, torch.float16),
]


def snapshot():
    from gated_delta import gated_delta_rule

    res = {}
    for n, (B, T, H, HV, K, V, dt, varlen, h0, bdt) in enumerate(CASES):
        gen = torch.Generator(device="cuda").manual_seed(1234 + n)

        def r(*shape):
            return torch.randn(*shape, device="cuda", generator=gen)

        q = F.normalize(r(B, T, H, K), dim=-1).to(dt).requires_grad_()
        k = F.normalize(r(B, T, H, K), dim=-1).to(dt).requires_grad_()
        v = r(B, T, HV, V).to(dt).requires_grad_()
        g = F.logsigmoid(r(B, T, HV) + 3).requires_grad_()
        beta = torch.sigmoid(r(B, T, HV)).to(bdt).requires_grad_()
        cu = torch.tensor([0, 100, 165, T], device="cuda", dtype=torch.int32) if varlen else None
        s0 = r(3 if varlen else B, HV, K, V).requires_grad_() if h0 else None
        o, ht = gated_delta_rule(q, k, v, g, beta, scale=K ** -0.5, initial_state=s0, output_final_state=True,
                                 cu_seqlens=cu)
        (o.float().square().sum() + ht.square().sum()).backward()
        named = [("o", o), ("ht", ht), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad), ("dg", g.grad),
                 ("dbeta", beta.grad)] + ([("dh0", s0.grad)] if h0 else [])
        for name, t in named:
            res[f"{n}.{name}"] = t.detach().cpu()
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("save").add_argument("out")
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    args = ap.parse_args()
    if args.cmd == "save":
        if not torch.cuda.is_available():
            sys.exit("grad_snapshot: needs a CUDA device")
        res = snapshot()
        torch.save(res, args.out)
        print(f"saved {len(res)} tensors to {args.out}")
        return
    a, b = torch.load(args.a), torch.load(args.b)
    if a.keys() != b.keys():
        sys.exit(f"grad_snapshot: the files hold different tensors: {sorted(a.keys() ^ b.keys())}")
    differ = [name for name in a if not torch.equal(a[name], b[name])]
    print(f"bitwise equal: {len(a) - len(differ)} of {len(a)}" + (f"; differ: {', '.join(differ)}" if differ else ""))
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
