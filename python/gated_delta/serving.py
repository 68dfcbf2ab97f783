"""Serving: decode against a pool of recurrent states, the way continuous-batching engines (vLLM, SGLang) keep them.

The engine owns one state cache per layer, `state_pool [num_slots, HV, K, V]`, and gives every running sequence one
slot (or, with speculative decoding, a few). One call advances N sequences by their new tokens, reading and
writing their states in place at those slots; prefill chunks and single decode tokens mix in one packed call.
"""
from typing import Optional

import torch

from . import _C  # noqa: F401  (loads the library that registers torch.ops.gated_delta)
from .ops import default_scale

__all__ = ["decode_pool", "PAD_SLOT_ID"]

PAD_SLOT_ID = -1
"""The slot index of a padded row (any negative index marks one; vLLM's PAD_SLOT_ID is -1)."""


def decode_pool(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    *,
    scale: Optional[float] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    num_accepted_tokens: Optional[torch.Tensor] = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    check_slots: bool = True,
) -> torch.Tensor:
    """The gated delta rule for the new tokens of N sequences whose states live in a shared pool, fused in one
    kernel, the pool updated in place. Per sequence n, value head h and token t (the rule of `gated_delta_rule`):

        S <- exp(g_t) S;  S <- S + beta_t k_t (v_t - S^T k_t)^T;  o_t = scale S^T q_t

    starting from the state in the sequence's read slot and writing the state back to the pool.

    Tokens: `q, k [B, T, H, K]`, `v [B, T, HV, V]` (HV a multiple of H), `g, beta [B, T, HV]`. Either N = B rows of
    T tokens each, or a packed batch (B = 1) of N sequences with `cu_seqlens [N + 1]` (int32/int64), where prefill
    chunks and decode tokens of any lengths (0 included) mix in one call.

    Slots: `state_pool [num_slots, HV, K, V]` float32 (float64 with float64 inputs, CPU), each slot's [HV, K, V]
    block contiguous (slots may be strided: a view into a larger cache works). `state_indices` int32/int64:

    - `[N]`: sequence n starts from slot `state_indices[n]` and its final state is written back there.
    - `[N, S]` (speculative decoding, vLLM's layout): every sequence owns S slots. It starts from slot
      `state_indices[n, num_accepted_tokens[n] - 1]` (column 0 when `num_accepted_tokens` is None), and the state
      after its token t is written to slot `state_indices[n, t]` (a negative entry skips that write), so that
      the pool holds the state after every draft token: when the verifier accepts a tokens of the draft, the next
      call passes `num_accepted_tokens[n] = a` and continues from the state after the last accepted token.
      Needs T_n <= S. The start slot is read before any write, so a row may write over its own start slot.

    Padding: a negative start slot (`PAD_SLOT_ID = -1`, or any negative number) marks a padded row: its state is
    neither read nor written and its outputs are zeros (so a CUDA graph captured for a fixed N can run fewer
    sequences).

    Gate and beta, as `gated_delta_rule` has them: `g` is the log decay, or with `use_gate_in_kernel` the raw gate
    `a` of `g = -exp(A_log) * softplus(a + dt_bias)` (A_log, dt_bias [HV]; dt_bias optional). `beta` is used as
    given, or with `use_beta_sigmoid_in_kernel` as logits (`sigmoid`, `2 * sigmoid` with `allow_neg_eigval`).
    `use_qk_l2norm_in_kernel` L2-normalises q and k per head. vLLM's two decode calls map as follows:
    `fused_sigmoid_gating_delta_rule_update(A_log, a, b, dt_bias, q, k, v, initial_state=pool,
    ssm_state_indices=idx, num_accepted_tokens=acc, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)` is
    `decode_pool(q, k, v, a, b, pool, idx, cu_seqlens=cu, num_accepted_tokens=acc, use_qk_l2norm_in_kernel=True,
    use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True)`, and
    `fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=pool, inplace_final_state=True, ...)` is
    `decode_pool(q, k, v, g, beta, pool, idx, ...)` with the same index arguments.

    Checks: `check_slots=True` validates the index values (cu_seqlens bounds, start slots and written slots in
    range, num_accepted_tokens in [1, S], T_n <= S, and that no slot is used by two sequences, which would race).
    On CUDA this copies the indices to the host once (one stream synchronisation), so serving loops and CUDA-graph
    capture pass `check_slots=False` (it raises under capture otherwise). Without the checks the kernels still
    never access memory outside the pool: a row whose start slot is >= num_slots or whose num_accepted_tokens is
    outside [1, S] is skipped and its outputs are NaN, out-of-range write slots are skipped, and cu_seqlens values
    are clamped to [0, T]; slots shared between sequences are the caller's responsibility.

    Returns o [B, T, HV, V] in v's dtype. Not differentiable. Equals, per sequence, `gated_delta_rule(...,
    initial_state=state_pool[start slot], output_final_state=True)` with the final state (or every intermediate
    state) stored back into the pool.
    """
    if scale is None:
        scale = default_scale(q)
    for name, flag in (("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel), ("use_gate_in_kernel",
                       use_gate_in_kernel), ("use_beta_sigmoid_in_kernel", use_beta_sigmoid_in_kernel),
                       ("allow_neg_eigval", allow_neg_eigval), ("check_slots", check_slots)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    return torch.ops.gated_delta.decode_pool(
        q, k, v, g, beta, state_pool, state_indices, cu_seqlens, num_accepted_tokens, float(scale),
        use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval,
        check_slots)


@torch.library.register_fake("gated_delta::decode_pool")
def _decode_pool_fake(q, k, v, g, beta, state_pool, state_indices, cu_seqlens, num_accepted_tokens, scale,
                      use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel,
                      allow_neg_eigval, check_slots):
    return v.new_empty(v.shape)
