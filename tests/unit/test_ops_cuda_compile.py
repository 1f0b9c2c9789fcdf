"""CUDA sources compile with nvcc for sm_80 and sm_90 even on machines without a GPU.

The kernels include no torch headers, so nvcc alone compiles them. The torch binding needs the
CUDA build of torch; against the CPU wheel (which lacks c10/cuda/impl/cuda_cmake_macros.h) we
check its syntax with that one generated header stubbed, so binding mistakes surface here too.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from slipstream.ops.builder import csrc_root, nvcc_path

CSRC = csrc_root()
CU_FILES = sorted(CSRC.rglob("*.cu"))
NVCC = nvcc_path()


def _skip_without_nvcc() -> None:
    if NVCC is None:
        reason = "nvcc not found (not on PATH, no CUDA_HOME or /usr/local/cuda): CUDA sources not compiled"
        print(f"SKIPPED: {reason}", file=sys.stderr)
        pytest.skip(reason)


def test_there_are_cuda_sources():
    assert [p.name for p in CU_FILES] == ["fused_adam_kernel.cu"]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("source", CU_FILES, ids=[p.name for p in CU_FILES])
def test_nvcc_compiles(source: Path, arch: str, tmp_path):
    _skip_without_nvcc()
    from slipstream.ops.specs import FUSED_ADAM

    cmd = [
        NVCC,
        "-c",
        f"-arch={arch}",
        "-std=c++17",
        *FUSED_ADAM.cuda_cflags,
        f"-I{CSRC / 'includes'}",
        str(source),
        "-o",
        str(tmp_path / f"{source.stem}.{arch}.o"),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / f"{source.stem}.{arch}.o").stat().st_size > 0


def test_cuda_binding_parses_against_torch_headers(tmp_path):
    _skip_without_nvcc()
    import sysconfig

    import torch
    from torch.utils.cpp_extension import include_paths

    homes = [os.environ.get("CUDA_HOME", ""), str(Path(NVCC).resolve().parent.parent), "/usr/local/cuda"]
    cuda_include = next(
        (Path(h) / "include" for h in homes if h and (Path(h) / "include" / "cuda_runtime_api.h").exists()), None
    )
    if cuda_include is None:
        pytest.skip(f"no CUDA headers found (CUDA_HOME, next to {NVCC}, /usr/local/cuda)")
    torch_include = Path(include_paths()[0])
    if not (torch_include / "c10" / "cuda" / "CUDAStream.h").exists():
        pytest.skip("this torch ships no c10/cuda headers")
    stub = tmp_path / "stub"
    if not (torch_include / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").exists():
        (stub / "c10" / "cuda" / "impl").mkdir(parents=True)
        (stub / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").write_text("#pragma once\n")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd = [
        "c++",
        "-std=c++20",
        "-fsyntax-only",
        "-DTORCH_EXTENSION_NAME=probe",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-I{stub}",
        f"-I{CSRC / 'includes'}",
        *(f"-isystem{p}" for p in include_paths()),
        f"-isystem{cuda_include}",
        f"-isystem{sysconfig.get_paths()['include']}",
        str(CSRC / "adam" / "fused_adam_binding.cpp"),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
