"""The warpgroup (wgmma) product wrappers of the CUDA kernels, checked on their own: tests/cuda/wgmma_check.cu is
compiled with nvcc for sm_90a and run; it compares 64 x 64 and 64 x 128 products (B K-major and N-major, read from
the 128-byte swizzled shared-memory layout; A from registers, or K- or M-major from that layout too, also negated)
with the host's, exactly. Needs a Hopper GPU and nvcc."""
import os
import subprocess

import pytest
import torch

from helpers import find_nvcc

HERE = os.path.dirname(os.path.abspath(__file__))

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_wgmma_wrappers_exact(tmp_path):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma needs compute capability 9.0 (sm_90a)")
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found")
    inc = os.path.join(os.path.dirname(torch.__file__), "include")
    exe = str(tmp_path / "wgmma_check")
    build = subprocess.run(
        [nvcc, "-std=c++17", "-O2", "-gencode=arch=compute_90a,code=sm_90a", f"-I{inc}", "-o", exe,
         os.path.join(HERE, "cuda", "wgmma_check.cu")],
        capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-4000:]
    run = subprocess.run([exe], capture_output=True, text=True, timeout=120)
    print(run.stdout)
    assert run.returncode == 0 and "WGTEST OK" in run.stdout, run.stdout + run.stderr
