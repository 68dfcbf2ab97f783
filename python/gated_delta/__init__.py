"""gated_delta: the gated delta rule (the token mixer of Gated DeltaNet) as a PyTorch C++/CUDA extension."""
from .ops import ALGORITHMS, chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, gated_delta_rule
from .reference import gated_delta_rule_ref
from . import reference
from .layer_ops import decode_step, gated_rmsnorm, l2norm, short_conv, short_conv_update
from .layers import GatedDeltaNet, GatedDeltaNetCache, GatedRMSNorm, ShortConvolution
from .serving import PAD_SLOT_ID, decode_pool

__version__ = "0.1.0"

__all__ = [
    "ALGORITHMS",
    "gated_delta_rule",
    "chunk_gated_delta_rule",
    "fused_recurrent_gated_delta_rule",
    "gated_delta_rule_ref",
    "reference",
    "GatedDeltaNet",
    "GatedDeltaNetCache",
    "ShortConvolution",
    "GatedRMSNorm",
    "short_conv",
    "short_conv_update",
    "gated_rmsnorm",
    "l2norm",
    "decode_step",
    "decode_pool",
    "PAD_SLOT_ID",
]
