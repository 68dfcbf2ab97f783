"""Helpers shared by the test suite, the benchmarks and the production checklist (gated_delta.checklist): one
forward and backward of the op, the bitwise comparison of repeated runs, and the warm-up before a CUDA graph
capture."""
from typing import Callable, Dict, List, Optional, Tuple

import torch

import gated_delta


def fwd_bwd(inputs: Dict[str, torch.Tensor], d_o: Optional[torch.Tensor] = None, **options):
    """One forward and backward of the op; returns the output, final state (or None) and the gradient of every
    input that requires one."""
    for x in inputs.values():
        if isinstance(x, torch.Tensor) and x.grad is not None:
            x.grad = None
    o, ht = gated_delta.gated_delta_rule(**inputs, **options)
    loss_terms = [(o * (d_o if d_o is not None else torch.ones_like(o))).sum()]
    if ht is not None:
        loss_terms.append(ht.sum() * 1e-3)
    torch.autograd.backward(loss_terms)
    grads = {k: x.grad for k, x in inputs.items() if isinstance(x, torch.Tensor) and x.requires_grad}
    return o, ht, grads


def bitwise_repeat_mismatches(make_inputs: Callable[[], Tuple[Dict[str, torch.Tensor], dict]],
                              runs: int = 3) -> List[str]:
    """Runs forward and backward `runs` times on fresh copies of the same inputs; returns the names of the
    tensors (output, final state, gradients) that were not bitwise equal to the first run."""
    first, mismatches = None, []
    for _ in range(runs):
        inputs, options = make_inputs()
        gen = torch.Generator().manual_seed(7)
        o, ht, grads = fwd_bwd(inputs, d_o=torch.randn(inputs["v"].shape, generator=gen).to(inputs["v"]),
                               **options)
        tensors = dict(o=o.detach(), final_state=ht.detach() if ht is not None else None,
                       **{"d" + k: g for k, g in grads.items()})
        if first is None:
            first = tensors
            continue
        for name, x in tensors.items():
            if name not in mismatches and not bitwise_equal(x, first[name]):
                mismatches.append(name)
    return mismatches


def bitwise_equal(a, b) -> bool:
    """Same shape, dtype and bytes (None equals only None)."""
    if a is None or b is None:
        return a is b

    def as_bytes(x):
        return x.detach().clone(memory_format=torch.contiguous_format).reshape(-1).view(torch.uint8)

    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(as_bytes(a), as_bytes(b))


def warm_up_for_capture(fn: Callable[[], object], iters: int) -> None:
    """Runs fn iters times on a side stream, then joins it to the current one: the warm-up a CUDA graph capture
    of fn needs."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(iters):
            fn()
    torch.cuda.current_stream().wait_stream(side)
