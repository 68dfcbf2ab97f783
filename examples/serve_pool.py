"""Continuous batching with a pool of recurrent states: a few requests of different lengths arrive and finish at
different steps; every step runs one packed call of a GatedDeltaNet layer in which prefill chunks and single decode
tokens of the running requests mix. The layer's projections, short convolutions and output norm run as in its
forward; the token mixer is `gated_delta.decode_pool` against a state pool, and the conv states live in a pool of
their own, indexed by the same slots. A request's slot is zeroed when it arrives and freed when it finishes.

At the end every request's outputs are compared with running that request alone through the layer (one forward
over its whole sequence); the script prints the max difference and exits non-zero when it is off.

    python examples/serve_pool.py [--device cpu|cuda] [--chunk 8]   (default: CUDA when available)
"""
import argparse
import os
import sys
from dataclasses import dataclass, field
from typing import List, Optional

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import gated_delta as gd  # noqa: E402


@dataclass
class Request:
    name: str
    arrival: int          # the step at which it arrives
    prompt_len: int
    gen_len: int          # decode tokens after the prompt
    x: Optional[torch.Tensor] = None  # [prompt_len + gen_len, hidden]: the layer's inputs, fixed up front
    done: int = 0         # tokens processed so far
    slot: int = -1
    outputs: List[torch.Tensor] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.prompt_len + self.gen_len


def pool_forward(layer: gd.GatedDeltaNet, x, cu_seqlens, slots, conv_pool, state_pool):
    """One packed step of the layer for N sequences: x [1, T, hidden] (sequence n holds tokens cu[n]:cu[n+1]),
    slots [N] their pool slots. Updates conv_pool (q, k, v: [num_slots, D, W - 1]) and state_pool
    ([num_slots, HV, K, V]) in place; returns y [1, T, hidden]."""
    _, T, _ = x.shape
    H, HV, K, V = layer.num_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    qkv = []
    for proj, conv, pool in zip((layer.q_proj, layer.k_proj, layer.v_proj),
                                (layer.q_conv1d, layer.k_conv1d, layer.v_conv1d), conv_pool):
        y, final = conv(proj(x), initial_state=pool[slots], output_final_state=True, cu_seqlens=cu_seqlens)
        pool[slots] = final
        qkv.append(y)
    q, k = layer._map_qk(qkv[0].view(1, T, H, K), qkv[1].view(1, T, H, K))
    o = gd.decode_pool(q, k, qkv[2].view(1, T, HV, V), layer.a_proj(x), layer.b_proj(x), state_pool, slots,
                       cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                       A_log=layer.A_log, dt_bias=layer.dt_bias, use_beta_sigmoid_in_kernel=True,
                       allow_neg_eigval=layer.allow_neg_eigval, check_slots=True)
    gate = layer.g_proj(x).view(1, T, HV, V) if layer.use_output_gate else None
    return layer.o_proj(layer.o_norm(o, gate).reshape(1, T, HV * V))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--chunk", type=int, default=8, help="prefill tokens per request per step")
    ap.add_argument("--slots", type=int, default=4, help="state pool size (slots are reused as requests finish)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    torch.manual_seed(0)

    hidden = 256
    layer = gd.GatedDeltaNet(hidden, num_heads=2, num_v_heads=4, head_dim=64, head_v_dim=64).to(dev).eval()
    requests = [Request("a", 0, 13, 6), Request("b", 0, 1, 9), Request("c", 2, 30, 4), Request("d", 3, 5, 1),
                Request("e", 5, 8, 7), Request("f", 9, 2, 3)]
    for r in requests:
        r.x = torch.randn(r.total, hidden, device=dev)

    W1 = layer.conv_size - 1
    conv_pool = tuple(torch.zeros(args.slots, d, W1, device=dev) for d in (layer.key_dim, layer.key_dim,
                                                                          layer.value_dim))
    state_pool = torch.zeros(args.slots, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim, device=dev)
    free = list(range(args.slots))
    running: List[Request] = []
    step = 0
    with torch.no_grad():
        while any(r.done < r.total for r in requests):
            for r in requests:
                if r.arrival == step:
                    r.slot = free.pop(0)
                    state_pool[r.slot].zero_()
                    for pool in conv_pool:
                        pool[r.slot].zero_()
                    running.append(r)
            if running:
                # each running request: its next prefill chunk, or one decode token
                lens = [min(args.chunk, r.prompt_len - r.done) if r.done < r.prompt_len else 1 for r in running]
                x = torch.cat([r.x[r.done:r.done + n] for r, n in zip(running, lens)])[None]
                cu = torch.tensor([0] + lens, device=dev).cumsum(0)
                slots = torch.tensor([r.slot for r in running], device=dev)
                y = pool_forward(layer, x, cu, slots, conv_pool, state_pool)[0]
                kinds = ["prefill" if r.done < r.prompt_len else "decode" for r in running]
                print(f"step {step:2d}: " + ", ".join(f"{r.name}:{k}x{n}@slot{r.slot}"
                                                     for r, k, n in zip(running, kinds, lens)))
                for r, n, a in zip(running, lens, cu[:-1].tolist()):
                    r.outputs.append(y[a:a + n])
                    r.done += n
                for r in [r for r in running if r.done == r.total]:
                    running.remove(r)
                    free.append(r.slot)
            step += 1

        worst = 0.0
        for r in requests:
            alone, _ = layer(r.x[None])
            diff = (torch.cat(r.outputs) - alone[0]).abs().max().item() / max(1.0, alone.abs().max().item())
            worst = max(worst, diff)
            print(f"request {r.name}: {r.prompt_len} prompt + {r.gen_len} decode tokens, arrived at step "
                  f"{r.arrival}; max |pooled - alone| / max(1, |alone|) = {diff:.2e}")
    tol = 1e-4
    print(f"device {dev}: max difference {worst:.2e} over {len(requests)} requests in {step} steps "
          f"({'ok' if worst <= tol else 'FAILED'}, tolerance {tol:.0e})")
    sys.exit(0 if worst <= tol else 1)


if __name__ == "__main__":
    main()
