"""nn.Modules: the Gated DeltaNet token-mixing layer and its parts (short convolution, gated RMSNorm).

Parameter names and shapes follow flash-linear-attention's `GatedDeltaNet`, `ShortConvolution` and
`FusedRMSNormGated`, so its checkpoints load with `load_state_dict`.
"""
import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import cp
from .layer_ops import decode_step, gated_rmsnorm, short_conv, short_conv_update
from .ops import ALGORITHMS, gated_delta_rule

__all__ = ["GatedDeltaNet", "GatedDeltaNetCache", "ShortConvolution", "GatedRMSNorm", "FEATURE_MAPS"]

FEATURE_MAPS = ("identity", "relu", "elu", "learnable")


class ShortConvolution(nn.Module):
    """Causal depthwise convolution over time followed by SiLU, on [B, T, D] inputs.

    `weight` is [D, 1, W] (the shape of a depthwise nn.Conv1d's weight), `bias` [D] when `bias=True`.
    The conv state of a sequence is its last W - 1 inputs, [N, D, W - 1], oldest first.
    """

    def __init__(self, hidden_size: int, kernel_size: int, bias: bool = False, activation: Optional[str] = "silu",
                 device=None, dtype=None):
        super().__init__()
        if kernel_size < 1:
            raise ValueError(f"kernel_size must be >= 1, got {kernel_size}")
        self.hidden_size = hidden_size
        self.kernel_size = kernel_size
        self.activation = activation
        self.weight = nn.Parameter(torch.empty(hidden_size, 1, kernel_size, device=device, dtype=dtype))
        if bias:
            self.bias = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self):
        # nn.Conv1d's default initialisation (fan_in = kernel_size for a depthwise convolution).
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1.0 / math.sqrt(self.kernel_size)
            nn.init.uniform_(self.bias, -bound, bound)

    def extra_repr(self) -> str:
        return (f"{self.hidden_size}, kernel_size={self.kernel_size}, bias={self.bias is not None}, "
                f"activation={self.activation}")

    def forward(self, x: torch.Tensor, initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
                cu_seqlens: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """x [B, T, D] -> (y [B, T, D], final conv state [N, D, W - 1] or None)."""
        return short_conv(x, self.weight.squeeze(1), self.bias, initial_state=initial_state,
                          output_final_state=output_final_state, cu_seqlens=cu_seqlens, activation=self.activation)

    def step(self, x: torch.Tensor, conv_state: torch.Tensor) -> torch.Tensor:
        """Decode: x [B, T, D] (few tokens); conv_state [B, D, W - 1] is updated in place."""
        return short_conv_update(x, conv_state, self.weight.squeeze(1), self.bias, activation=self.activation)


class GatedRMSNorm(nn.Module):
    """RMSNorm over the last dimension with an optional SiLU output gate, computed in float32:
    y = x / sqrt(mean(x^2) + eps) * weight * silu(gate)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, elementwise_affine: bool = True, device=None,
                 dtype=None):
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"

    def forward(self, x: torch.Tensor, gate: Optional[torch.Tensor] = None) -> torch.Tensor:
        return gated_rmsnorm(x, gate, self.weight, self.eps)


class LearnableFeatureMap(nn.Module):
    """A linear map per head, x [..., H, K] -> x W_h, shared by q and k. Each head's K x K block starts
    orthogonal (from a QR decomposition), so at initialisation it preserves norms and q.k products."""

    def __init__(self, num_heads: int, head_dim: int, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_heads, head_dim, head_dim, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self):
        with torch.no_grad():
            for h in range(self.weight.shape[0]):
                a = torch.randn(self.weight.shape[1], self.weight.shape[2], dtype=torch.float64)
                q, r = torch.linalg.qr(a)
                q = q * torch.sign(torch.diagonal(r))[None, :]  # a uniformly (Haar) distributed orthogonal block
                self.weight[h].copy_(q)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [..., H, 1, K] @ [H, K, K] -> [..., H, 1, K]
        return torch.matmul(x.unsqueeze(-2), self.weight.to(x.dtype)).squeeze(-2)


@dataclass
class GatedDeltaNetCache:
    """What one GatedDeltaNet layer keeps between calls, per sequence n:
    conv_state: (q, k, v) conv states, each [N, D, W - 1] in the activations' dtype (None without short conv);
    recurrent_state: [N, HV, K, V] float32 (float64 for a float64 model)."""

    conv_state: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    recurrent_state: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.recurrent_state.shape[0]


class GatedDeltaNet(nn.Module):
    """The Gated DeltaNet token mixer (Yang et al., "Gated Delta Networks"), x [B, T, hidden_size] ->
    y [B, T, hidden_size]:

        q, k, v = silu(short_conv(x W_q)), silu(short_conv(x W_k)), silu(short_conv(x W_v))
        q, k    = feature_map(q), feature_map(k), then L2-normalised per head (in the kernel)
        g       = -exp(A_log) * softplus(x W_a + dt_bias),   beta = sigmoid(x W_b) (x2 with allow_neg_eigval)
        o       = gated_delta_rule(q, k, v, g, beta)
        y       = (rmsnorm(o) * weight * silu(x W_g)) W_o        (per value head)

    Args:
        hidden_size: model width.
        num_heads: query/key heads H. num_v_heads: value heads HV (a multiple of H; default H).
        head_dim: K (default hidden_size // num_heads). head_v_dim: V (default int(head_dim * expand_v)).
        conv_size: width W of the short convolutions; conv_bias: give them a bias; use_short_conv: else silu only.
        use_output_gate: gate the output norm with silu(x W_g) (else a plain RMSNorm).
        norm_eps: eps of the output norm. allow_neg_eigval: beta in [0, 2).
        algorithm, chunk_size: passed to `gated_delta_rule` for prefill and training.
        feature_map: applied to q and k after the convolution: "identity" (default), "relu", "elu" (elu + 1), or
            "learnable" (a per-head linear map shared by q and k, initialised block-orthogonal).
        layer_idx: kept for model code that indexes caches by layer.
        cp_group: a torch.distributed process group over which the token dimension is split (context parallelism):
            each rank passes its slice of x (and the global cu_seqlens); the short convolutions exchange a halo of
            conv_size - 1 tokens and the gated delta rule runs across the group (see `gated_delta.cp`). Parameter
            gradients are then this rank's share: all-reduce (sum) them over the group. No cache with cp_group.

    `forward(x, cache=None, use_cache=False, cu_seqlens=None)` returns (y, new_cache), new_cache None unless
    use_cache. With a cache and at most `decode_max_tokens` new tokens (and no gradient needed) the layer takes the
    decode path: fused conv updates and one fused decode-step kernel, updating the cache's tensors in place.
    Otherwise it runs the chunked op from the cached states (prefill) and returns a cache with new tensors.
    """

    decode_max_tokens = 16

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_v_heads: Optional[int] = None,
        head_dim: Optional[int] = None,
        head_v_dim: Optional[int] = None,
        *,
        expand_v: float = 1.0,
        conv_size: int = 4,
        conv_bias: bool = False,
        use_short_conv: bool = True,
        use_output_gate: bool = True,
        norm_eps: float = 1e-5,
        allow_neg_eigval: bool = False,
        algorithm: str = "auto",
        chunk_size: int = 64,
        feature_map: Optional[str] = None,
        layer_idx: Optional[int] = None,
        cp_group=None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        num_v_heads = num_heads if num_v_heads is None else num_v_heads
        if hidden_size < 1 or num_heads < 1:
            raise ValueError(f"hidden_size and num_heads must be >= 1, got {hidden_size} and {num_heads}")
        if num_v_heads < 1 or num_v_heads % num_heads != 0:
            raise ValueError(f"num_v_heads must be a multiple of num_heads={num_heads}, got {num_v_heads}")
        if head_dim is None:
            if hidden_size % num_heads != 0:
                raise ValueError(f"head_dim is needed when hidden_size={hidden_size} is not a multiple of "
                                 f"num_heads={num_heads}")
            head_dim = hidden_size // num_heads
        if head_v_dim is None:
            head_v_dim = int(head_dim * expand_v)
        if head_dim < 1 or head_v_dim < 1:
            raise ValueError(f"head_dim and head_v_dim must be >= 1, got {head_dim} and {head_v_dim}")
        if conv_size < 1:
            raise ValueError(f"conv_size must be >= 1, got {conv_size}")
        feature_map = "identity" if feature_map is None else feature_map
        if feature_map not in FEATURE_MAPS:
            raise ValueError(f"feature_map must be one of {FEATURE_MAPS} or None, got {feature_map!r}")
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be an integer >= 1, got {chunk_size!r}")

        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.num_v_heads = num_v_heads
        self.head_dim = head_dim
        self.head_k_dim = head_dim
        self.head_v_dim = head_v_dim
        self.key_dim = num_heads * head_dim
        self.value_dim = num_v_heads * head_v_dim
        self.conv_size = conv_size
        self.use_short_conv = use_short_conv
        self.use_output_gate = use_output_gate
        self.norm_eps = norm_eps
        self.allow_neg_eigval = allow_neg_eigval
        self.algorithm = algorithm
        self.chunk_size = chunk_size
        self.feature_map = feature_map
        self.layer_idx = layer_idx
        self.cp_group = cp_group

        fk = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False, **fk)
        self.k_proj = nn.Linear(hidden_size, self.key_dim, bias=False, **fk)
        self.v_proj = nn.Linear(hidden_size, self.value_dim, bias=False, **fk)
        self.a_proj = nn.Linear(hidden_size, num_v_heads, bias=False, **fk)
        self.b_proj = nn.Linear(hidden_size, num_v_heads, bias=False, **fk)
        self.A_log = nn.Parameter(torch.empty(num_v_heads, device=device, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(num_v_heads, device=device, dtype=torch.float32))
        self.A_log._no_weight_decay = True
        self.dt_bias._no_weight_decay = True
        if use_short_conv:
            self.q_conv1d = ShortConvolution(self.key_dim, conv_size, bias=conv_bias, **fk)
            self.k_conv1d = ShortConvolution(self.key_dim, conv_size, bias=conv_bias, **fk)
            self.v_conv1d = ShortConvolution(self.value_dim, conv_size, bias=conv_bias, **fk)
        self.qk_feature_map = LearnableFeatureMap(num_heads, head_dim, **fk) if feature_map == "learnable" else None
        if use_output_gate:
            self.g_proj = nn.Linear(hidden_size, self.value_dim, bias=False, **fk)
        self.o_norm = GatedRMSNorm(head_v_dim, eps=norm_eps, **fk)
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False, **fk)
        self.reset_gate_parameters()

    @torch.no_grad()
    def reset_gate_parameters(self, dt_min: float = 1e-3, dt_max: float = 0.1, dt_init_floor: float = 1e-4):
        """The paper's initialisation of the decay: A ~ U(0, 16) (A_log = log A); dt log-uniform in
        [dt_min, dt_max], dt_bias = softplus^-1(dt) = dt + log(-expm1(-dt))."""
        A = torch.empty_like(self.A_log, dtype=torch.float32).uniform_(0, 16).clamp_(min=1e-4)
        self.A_log.copy_(torch.log(A))
        u = torch.rand_like(self.dt_bias, dtype=torch.float32)
        dt = torch.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp_(min=dt_init_floor)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    # ---- cache ----

    def state_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float64 if dtype == torch.float64 else torch.float32

    def empty_cache(self, batch_size: int, dtype: Optional[torch.dtype] = None,
                    device: Optional[torch.device] = None) -> GatedDeltaNetCache:
        """A zero cache for batch_size sequences (what a forward with no cache starts from). dtype is the
        activations' dtype (default: the projection weights')."""
        dtype = self.q_proj.weight.dtype if dtype is None else dtype
        device = self.q_proj.weight.device if device is None else device
        conv = None
        if self.use_short_conv:
            W1 = self.conv_size - 1
            conv = tuple(torch.zeros(batch_size, d, W1, dtype=dtype, device=device)
                         for d in (self.key_dim, self.key_dim, self.value_dim))
        rec = torch.zeros(batch_size, self.num_v_heads, self.head_k_dim, self.head_v_dim,
                          dtype=self.state_dtype(dtype), device=device)
        return GatedDeltaNetCache(conv, rec)

    def _check_inputs(self, x, cache, cu_seqlens):
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.hidden_size:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x must have shape [B, T, hidden_size={self.hidden_size}], got {got}")
        if cu_seqlens is not None:
            if x.shape[0] != 1:
                raise ValueError(f"cu_seqlens requires a packed batch with B = 1, got x of shape {tuple(x.shape)}")
            if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
                raise ValueError(f"cu_seqlens must be a 1-D tensor [N + 1] with N >= 1, got "
                                 f"{tuple(cu_seqlens.shape)}")
        n = x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        if cache is not None:
            if not isinstance(cache, GatedDeltaNetCache):
                raise TypeError(f"cache must be a GatedDeltaNetCache, got {type(cache).__name__}")
            if cache.batch_size != n:
                raise ValueError(f"cache holds {cache.batch_size} sequences, but the input has {n}")
            if (cache.conv_state is None) == self.use_short_conv:
                raise ValueError("cache.conv_state must be a (q, k, v) tuple exactly when use_short_conv=True")
        return n

    # ---- forward ----

    def _map_qk(self, q: torch.Tensor, k: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        if self.feature_map == "relu":
            return F.relu(q), F.relu(k)
        if self.feature_map == "elu":
            return F.elu(q) + 1.0, F.elu(k) + 1.0
        if self.feature_map == "learnable":
            return self.qk_feature_map(q), self.qk_feature_map(k)
        return q, k

    def forward(
        self,
        x: torch.Tensor,
        cache: Optional[GatedDeltaNetCache] = None,
        use_cache: bool = False,
        cu_seqlens: Optional[torch.Tensor] = None,
    ) -> Tuple[torch.Tensor, Optional[GatedDeltaNetCache]]:
        """x [B, T, hidden_size] (B = 1 with cu_seqlens [N + 1]) -> (y [B, T, hidden_size], cache or None)."""
        self._check_inputs(x, cache, cu_seqlens)
        B, T, _ = x.shape
        layout = None
        if self.cp_group is not None:
            if cache is not None or use_cache:
                raise ValueError("GatedDeltaNet with cp_group runs without a cache (cache=None, use_cache=False)")
            layout = cp.cp_layout(self.cp_group, T, B, cu_seqlens, device=x.device)
        need_grad = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in self.parameters()))
        decode = (use_cache and cache is not None and cu_seqlens is None and 1 <= T <= self.decode_max_tokens
                  and not need_grad)
        H, HV, K, V = self.num_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim

        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        conv_state = None
        if self.use_short_conv:
            if decode:
                cq, ck, cv = cache.conv_state
                q = self.q_conv1d.step(q, cq)
                k = self.k_conv1d.step(k, ck)
                v = self.v_conv1d.step(v, cv)
            elif layout is not None:  # the slice's pieces, with the previous ranks' last inputs as a halo
                local_cu = layout.local_cu_seqlens()
                local_cu = torch.tensor(local_cu, device=x.device) if local_cu is not None else None
                h0 = cp.cp_short_conv_initial_state(torch.cat([q, k, v], -1), self.conv_size - 1, layout,
                                                    self.cp_group)
                h0 = ((None,) * 3 if h0 is None else
                      tuple(t.contiguous() for t in h0.split([self.key_dim, self.key_dim, self.value_dim], 1)))
                q, _ = self.q_conv1d(q, h0[0], False, local_cu)
                k, _ = self.k_conv1d(k, h0[1], False, local_cu)
                v, _ = self.v_conv1d(v, h0[2], False, local_cu)
            else:
                h0 = cache.conv_state if cache is not None else (None, None, None)
                q, cq = self.q_conv1d(q, h0[0], use_cache, cu_seqlens)
                k, ck = self.k_conv1d(k, h0[1], use_cache, cu_seqlens)
                v, cv = self.v_conv1d(v, h0[2], use_cache, cu_seqlens)
                conv_state = (cq, ck, cv)
        else:
            q, k, v = F.silu(q), F.silu(k), F.silu(v)
        q, k = self._map_qk(q.view(B, T, H, K), k.view(B, T, H, K))
        v = v.view(B, T, HV, V)
        a, b = self.a_proj(x), self.b_proj(x)

        if decode:
            o = decode_step(q, k, v, a, b, self.A_log, self.dt_bias, cache.recurrent_state,
                            allow_neg_eigval=self.allow_neg_eigval)
            new_cache = cache
        else:
            h0 = cache.recurrent_state if cache is not None else None
            o, state = gated_delta_rule(
                q, k, v, a, b, initial_state=h0, output_final_state=use_cache, cu_seqlens=cu_seqlens,
                use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                allow_neg_eigval=self.allow_neg_eigval, use_gate_in_kernel=True, A_log=self.A_log,
                dt_bias=self.dt_bias, algorithm=self.algorithm, chunk_size=self.chunk_size, cp_group=self.cp_group)
            new_cache = GatedDeltaNetCache(conv_state, state) if use_cache else None

        gate = self.g_proj(x).view(B, T, HV, V) if self.use_output_gate else None
        o = self.o_norm(o, gate)
        y = self.o_proj(o.reshape(B, T, HV * V))
        return y, new_cache
