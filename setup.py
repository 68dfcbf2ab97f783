"""Build of the gated_delta PyTorch extension.

Environment variables (read by CMakeLists.txt too):
  GATED_DELTA_CUDA_ARCHS   CUDA architectures to build, ';'-separated (default "9.0a"; "9.0a" builds sm_90a).
  GATED_DELTA_FORCE_CUDA   "1": build the CUDA kernels even when no GPU is visible (needs a CUDA torch and nvcc).
  GATED_DELTA_NO_CUDA      "1": build the CPU kernels only.
  MAX_JOBS                 parallel compile jobs (ninja).
"""
import glob
import os

from setuptools import find_packages, setup

import torch
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))


def _flag(name):
    return os.environ.get(name, "0").lower() in ("1", "true", "yes", "on")


def _want_cuda():
    if _flag("GATED_DELTA_NO_CUDA"):
        return False
    has_toolkit = torch.version.cuda is not None and CUDA_HOME is not None
    if _flag("GATED_DELTA_FORCE_CUDA"):
        if not has_toolkit:
            raise RuntimeError("GATED_DELTA_FORCE_CUDA=1 needs a CUDA build of torch and nvcc (CUDA_HOME)")
        return True
    return has_toolkit and torch.cuda.is_available()


def _gencode_flags():
    archs = os.environ.get("GATED_DELTA_CUDA_ARCHS", "9.0a")
    flags = []
    for arch in filter(None, (a.strip() for a in archs.replace(",", ";").split(";"))):
        num = arch.replace(".", "")
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
    return flags


# Link the C++ standard library dynamically, by name: a toolchain whose g++ links libstdc++ statically would give
# the extension a private copy whose locale state is never initialised (streaming a number into an error message
# then crashes), and the extension must share torch's libstdc++ anyway.
LINK_ARGS = ["-fopenmp", "-Wl,-Bdynamic", "-l:libstdc++.so.6"]


def _extensions():
    rel = lambda paths: sorted(os.path.relpath(p, ROOT) for p in paths)  # noqa: E731
    # csrc/*.cpp (schemas, autograd, checks) and the CPU backend, csrc/cpu/**; the CUDA backend is csrc/cuda/**
    src = lambda *parts: glob.glob(os.path.join(ROOT, "csrc", *parts), recursive=True)  # noqa: E731
    sources = rel(src("*.cpp") + src("cpu", "**", "*.cpp"))
    # The C++ standard is left to torch.utils.cpp_extension, which matches the one torch was built with (C++20):
    # mixing standards across the torch headers breaks the one-definition rule.
    cxx = ["-O3", "-fopenmp", "-DGATED_DELTA_PYTHON_MODULE"]
    define_macros = [("Py_LIMITED_API", "0x03090000")]
    if _want_cuda():
        sources += rel(src("cuda", "**", "*.cu") + src("cuda", "**", "*.cpp"))
        nvcc = ["-O3", "--use_fast_math", "--expt-relaxed-constexpr", "-lineinfo",
                "-DGATED_DELTA_WITH_CUDA"] + _gencode_flags()
        return [CUDAExtension("gated_delta._C", sources,
                              extra_compile_args={"cxx": cxx + ["-DGATED_DELTA_WITH_CUDA"], "nvcc": nvcc},
                              extra_link_args=LINK_ARGS, define_macros=define_macros, py_limited_api=True)]
    return [CppExtension("gated_delta._C", sources, extra_compile_args={"cxx": cxx},
                         extra_link_args=LINK_ARGS, define_macros=define_macros, py_limited_api=True)]


setup(
    name="gated_delta",
    version="0.1.0",
    description="The gated delta rule (Gated DeltaNet token mixer) as a PyTorch C++/CUDA extension",
    package_dir={"": "python"},
    packages=find_packages("python"),
    ext_modules=_extensions(),
    cmdclass={"build_ext": BuildExtension},
    options={"bdist_wheel": {"py_limited_api": "cp39"}},
    python_requires=">=3.9",
    install_requires=["torch>=2.4"],
)
