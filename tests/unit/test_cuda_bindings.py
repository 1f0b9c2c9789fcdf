"""The CUDA ops' torch bindings compile and link against a CUDA build of torch, on a machine without a GPU.

``test_ops_cuda_compile.py`` compiles the kernels with nvcc alone and parses the binding against
the CPU wheel's headers; this builds the whole op the way a user's GPU machine does
(``slipstream.ops.builder._compile``: the binding with torch's CUDA headers, the kernel with nvcc,
linked into an importable extension), with a CUDA build of torch installed in a virtual
environment of its own, so the project's own environment never holds a CUDA build.

The CUDA wheel is found on this machine's local package store (``SLIPSTREAM_CUDA_TORCH_WHEEL``
overrides); the environment is made once (about 45 s, 5.4 GB) under
``~/.cache/slipstream/cuda-torch`` (``SLIPSTREAM_CUDA_TORCH_VENV`` overrides) and reused. Where no
such wheel or no nvcc exists, the test skips and says which.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from slipstream.ops.builder import nvcc_path

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("SLIPSTREAM_CUDA_TORCH_VENV", Path.home() / ".cache" / "slipstream" / "cuda-torch"))
WHEELS = [
    os.environ.get("SLIPSTREAM_CUDA_TORCH_WHEEL", ""),
    "/opt/pypi-more/files/torch-2.14.1-cp311-*.whl",
    "/opt/wheels/torch-2.14.1-cp311-*.whl",
]

# Runs inside the CUDA venv: the op builder and the op specs loaded from the checkout by file, so
# slipstream's own dependencies (pydantic, ...) are not needed there.
BUILD = textwrap.dedent("""
    import importlib.util, sys, types
    from pathlib import Path
    root, target = Path(sys.argv[1]), Path(sys.argv[2])
    for name in ("slipstream", "slipstream.utils", "slipstream.ops"):
        sys.modules[name] = types.ModuleType(name)
    def load(name, path):
        spec = importlib.util.spec_from_file_location(name, root / path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module
    load("slipstream.utils.logging", "slipstream/utils/logging.py")
    load("slipstream.errors", "slipstream/errors.py")
    builder = load("slipstream.ops.builder", "slipstream/ops/builder.py")
    specs = load("slipstream.ops.specs", "slipstream/ops/specs.py")
    import torch
    assert torch.version.cuda, "not a CUDA build of torch"
    module = builder._compile(specs.FUSED_ADAM, target)
    print("built", torch.__version__, torch.version.cuda, module.__file__, hasattr(module, "fused_adam_step") or dir(module))
""")


def _cuda_python() -> Path:
    python = VENV / "bin" / "python"
    if python.exists():
        return python
    wheel = next((w for pattern in WHEELS if pattern for w in sorted(glob.glob(pattern))), None)
    if wheel is None:
        pytest.skip(
            f"no CUDA build of torch on this machine (looked for {', '.join(p for p in WHEELS if p)}); set SLIPSTREAM_CUDA_TORCH_WHEEL"
        )
    VENV.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV)], check=True, timeout=120)
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", wheel, "ninja"], capture_output=True, text=True, timeout=900
    )
    if done.returncode != 0:
        pytest.fail(f"installing {wheel} into {VENV} failed: {done.stderr.strip().splitlines()[-1:]}")
    return python


def test_cuda_op_builds_against_cuda_torch(tmp_path: Path) -> None:
    nvcc = nvcc_path()
    if nvcc is None:
        pytest.skip("nvcc not found (PATH, CUDA_HOME, /usr/local/cuda): the CUDA op cannot be compiled here")
    homes = [os.environ.get("CUDA_HOME", ""), str(Path(nvcc).resolve().parent.parent), "/usr/local/cuda"]
    cuda_home = next((h for h in homes if h and (Path(h) / "include" / "cuda_runtime.h").exists()), None)
    if cuda_home is None:
        pytest.skip(f"no CUDA headers next to {nvcc} (CUDA_HOME, /usr/local/cuda)")
    python = _cuda_python()
    env = {**os.environ, "TORCH_CUDA_ARCH_LIST": "8.0;9.0", "CUDA_HOME": cuda_home, "PYTHONPATH": ""}
    env.pop("SLIPSTREAM_ACCELERATOR", None)
    done = subprocess.run(
        [str(python), "-c", BUILD, str(ROOT), str(tmp_path)], capture_output=True, text=True, timeout=900, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "built" in done.stdout and "+cu" in done.stdout, done.stdout
    library = next(tmp_path.glob("slipstream_fused_adam*.so"))
    assert library.stat().st_size > 0
    objdump = subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True, text=True)
    assert "PyInit_slipstream_fused_adam" in objdump.stdout


def test_cpu_only_install_never_pulls_a_cuda_build() -> None:
    """The project's own environment (scripts/setup.sh pins whatever torch is present) holds a CPU build."""
    import torch

    assert torch.version.cuda is None or os.environ.get("CI_HAS_CUDA_TORCH"), (
        f"the test environment has a CUDA build of torch ({torch.__version__})"
    )
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert 'echo "torch==${TORCH_VERSION}" > "$CONSTRAINTS"' in setup  # dependencies resolve against the torch present
