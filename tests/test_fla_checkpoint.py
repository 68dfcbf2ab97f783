"""A flash-linear-attention `GatedDeltaNet` layer's weights load into ours and give the same function.

FLA's layer (Triton kernels) runs on CUDA only, so these tests are marked `gpu` and skip without a CUDA device or
without the `fla` package (`pip install flash-linear-attention`). Both layers hold the same weights; each output
is compared with our layer in float64 on the CPU (the sequential reference path), so the test says both that the
mapping is exact and how far each implementation's bf16 result lies from the float64 function.
"""
import importlib
import os
import sys
import types

import pytest
import torch

import gated_delta as gd

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _fla_layer_class():
    """FLA's GatedDeltaNet layer class, or None. `fla.layers` imports every layer of FLA's model zoo (some need
    packages we do not); when that fails, load only the modules the Gated DeltaNet layer needs."""
    try:
        return importlib.import_module("fla.layers.gated_deltanet").GatedDeltaNet
    except Exception:  # noqa: BLE001
        pass
    try:
        fla = importlib.import_module("fla")
    except Exception:  # noqa: BLE001
        return None
    for name in [m for m in sys.modules if m == "fla.layers" or m.startswith("fla.layers.")]:
        del sys.modules[name]
    pkg = types.ModuleType("fla.layers")
    pkg.__path__ = [os.path.join(os.path.dirname(fla.__file__), "layers")]
    sys.modules["fla.layers"] = pkg
    try:
        return importlib.import_module("fla.layers.gated_deltanet").GatedDeltaNet
    except Exception:  # noqa: BLE001
        return None


FLA_LAYER = _fla_layer_class() if torch.cuda.is_available() else None
needs_fla = pytest.mark.skipif(FLA_LAYER is None, reason="needs flash-linear-attention's GatedDeltaNet layer")


def rel(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).norm() / b.norm()).item()


@needs_fla
@pytest.mark.parametrize("H,HV,K,expand_v,allow_neg", [(4, 4, 64, 2.0, False), (2, 4, 128, 1.0, True)])
@pytest.mark.parametrize("T", [1, 65, 300])
def test_fla_weights_load_and_match(H, HV, K, expand_v, allow_neg, T):
    torch.manual_seed(T * 7 + H)
    hidden = 256
    fla = FLA_LAYER(hidden_size=hidden, expand_v=expand_v, head_dim=K, num_heads=H, num_v_heads=HV, mode="chunk",
                    use_gate=True, use_short_conv=True, allow_neg_eigval=allow_neg, conv_size=4, norm_eps=1e-5,
                    layer_idx=0).cuda()
    # FLA initialises o_norm's weight to ones and the convolutions like nn.Conv1d; make every weight matter
    with torch.no_grad():
        for p in fla.parameters():
            if p.dim() == 1 and p.numel() == fla.head_v_dim:
                p.uniform_(0.5, 1.5)
    state = {k: v.detach().clone() for k, v in fla.state_dict().items()}

    ours = gd.GatedDeltaNet(hidden, num_heads=H, num_v_heads=HV, head_dim=K, expand_v=expand_v, conv_size=4,
                            use_short_conv=True, use_output_gate=True, allow_neg_eigval=allow_neg, norm_eps=1e-5)
    ours.load_state_dict(state, strict=True)  # raises on any missing, unexpected or mis-shaped name
    ref = ours.double()  # float64 on the CPU: the reference function of these weights

    x = torch.randn(2, T, hidden, dtype=torch.float64)
    with torch.no_grad():
        y_ref, _ = ref(x)
        fla_bf16 = fla.to(torch.bfloat16).train()  # train mode: FLA's chunk path for every T
        y_fla = fla_bf16(x.cuda().to(torch.bfloat16))[0]
        ours_cuda = gd.GatedDeltaNet(hidden, num_heads=H, num_v_heads=HV, head_dim=K, expand_v=expand_v,
                                     conv_size=4, allow_neg_eigval=allow_neg, norm_eps=1e-5)
        ours_cuda.load_state_dict(state, strict=True)
        ours_cuda = ours_cuda.cuda().to(torch.bfloat16)
        y_ours, _ = ours_cuda(x.cuda().to(torch.bfloat16))
    e_fla, e_ours = rel(y_fla, y_ref), rel(y_ours, y_ref)
    print(f"rel err vs float64: FLA {e_fla:.2e}, gated_delta {e_ours:.2e}")
    # bf16 weights and activations through five projections: a few 1e-3 each; a wrong mapping gives O(1)
    assert e_fla < 3e-2, f"FLA's layer with its own weights is {e_fla:.2e} from our float64 layer"
    assert e_ours < 3e-2, f"our bf16 CUDA layer is {e_ours:.2e} from our float64 layer"
