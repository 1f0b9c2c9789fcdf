"""``slipstream report``: the environment facts a bug report needs, one per line.

Every fact is gathered on its own and a failure to gather one becomes its value
("unavailable: ..."), so the report still prints on a broken install — that is when it is needed.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Callable
from functools import cache
from typing import Any

Section = tuple[str, list[tuple[str, str]]]

# Vector extensions that decide which CPU kernels torch and our ops can use (py-cpuinfo's names).
_SIMD_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_bf16",
    "avx512_fp16",
    "amx_bf16",
    "asimd",
    "sve",
)


def collect() -> list[Section]:
    """Gather every section; imports torch, cpuinfo and psutil."""
    return [
        ("slipstream and python", _slipstream_facts()),
        ("torch", _torch_facts()),
        ("cuda", _cuda_facts()),
        ("build tools", _build_tool_facts()),
        ("cpu and memory", _host_facts()),
        ("compiled ops", _op_facts()),
    ]


def format_report(sections: list[Section]) -> str:
    width = max(len(key) for _, facts in sections for key, _ in facts) + 2
    lines = []
    for title, facts in sections:
        lines.append(f"--- {title}")
        lines.extend(f"{key + ' ':.<{width}} {value}" for key, value in facts)
    return "\n".join(lines)


def main() -> int:
    print(format_report(collect()))
    return 0


def _fact(key: str, get: Callable[[], str]) -> tuple[str, str]:
    try:
        return key, get()
    except Exception as err:  # a broken piece of the environment is itself the fact to report
        return key, f"unavailable: {type(err).__name__}: {err}"


def _slipstream_facts() -> list[tuple[str, str]]:
    def version() -> str:
        import slipstream
        from slipstream.version import __version__

        return f"{__version__} ({os.path.dirname(slipstream.__file__)})"

    return [
        _fact("slipstream", version),
        _fact("python", lambda: f"{platform.python_version()} ({sys.executable})"),
        _fact("platform", platform.platform),
    ]


def _torch_facts() -> list[tuple[str, str]]:
    def version() -> str:
        import torch

        return f"{torch.__version__} ({os.path.dirname(torch.__file__)})"

    def build() -> str:
        import torch

        if torch.version.cuda:
            kind = f"CUDA {torch.version.cuda}"
        elif getattr(torch.version, "hip", None):
            kind = f"ROCm/HIP {torch.version.hip}"
        else:
            kind = "CPU only"
        # The C++ ABI must match for ops compiled against this torch.
        abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
        debug = ", debug build" if torch.version.debug else ""
        return f"{kind}, _GLIBCXX_USE_CXX11_ABI={abi}{debug}"

    def cpu_capability() -> str:
        import torch

        return torch.backends.cpu.get_cpu_capability()

    def backends() -> str:
        import torch.distributed as dist

        if not dist.is_available():
            return "none (torch built without torch.distributed)"
        checks = {"gloo": dist.is_gloo_available, "nccl": dist.is_nccl_available, "mpi": dist.is_mpi_available}
        found = [name for name, available in checks.items() if available()]
        return ", ".join(found) or "none"

    return [
        _fact("torch", version),
        _fact("torch build", build),
        _fact("torch cpu kernels", cpu_capability),
        _fact("torch.distributed backends", backends),
    ]


def _cuda_facts() -> list[tuple[str, str]]:
    def devices() -> str:
        import torch

        if not torch.cuda.is_available():
            return "none (torch.cuda.is_available() is False)"
        parts = []
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            parts.append(f"{i}: {props.name} sm_{props.major}{props.minor} {props.total_memory / 2**30:.1f} GiB")
        return "; ".join(parts)

    def compiled_archs() -> str:
        import torch

        return " ".join(torch.cuda.get_arch_list()) or "none"

    def nccl() -> str:
        import torch

        version = torch.cuda.nccl.version()
        return ".".join(str(v) for v in version) if isinstance(version, tuple) else str(version)

    facts = [_fact("cuda devices", devices)]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        facts.append(("CUDA_VISIBLE_DEVICES", visible))
    if _torch_has_cuda():
        facts += [_fact("torch cuda archs", compiled_archs), _fact("nccl", nccl)]
    facts.append(_fact("nvcc", _nvcc))
    return facts


def _torch_has_cuda() -> bool:
    try:
        import torch

        return bool(torch.version.cuda)
    except Exception:
        return False


def _nvcc() -> str:
    nvcc = shutil.which("nvcc")
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if nvcc is None and cuda_home and os.path.isfile(os.path.join(cuda_home, "bin", "nvcc")):
        nvcc = os.path.join(cuda_home, "bin", "nvcc")
    if nvcc is None:
        return "not found (not on PATH, no CUDA_HOME)"
    release = [line for line in _run([nvcc, "--version"]).splitlines() if "release" in line]
    return f"{release[-1].strip() if release else 'unknown version'} ({nvcc})"


def _build_tool_facts() -> list[tuple[str, str]]:
    def ninja() -> str:
        # JIT op builds run `ninja` from PATH; the PyPI package puts one next to the interpreter,
        # which is on PATH only when the environment is activated.
        parts = []
        try:
            import ninja as ninja_pkg

            parts.append(f"PyPI package {ninja_pkg.__version__} ({ninja_pkg.BIN_DIR})")
        except ImportError:
            parts.append("PyPI package not installed")
        on_path = shutil.which("ninja")
        if on_path:
            parts.append(f"on PATH {_run([on_path, '--version']).strip()} ({on_path})")
        else:
            parts.append("not on PATH")
        return "; ".join(parts)

    def compiler(name: str) -> Callable[[], str]:
        def get() -> str:
            path = shutil.which(name)
            if path is None:
                return "not found on PATH"
            return f"{_run([path, '--version']).splitlines()[0].strip()} ({path})"

        return get

    facts = [_fact("ninja", ninja), _fact("g++", compiler("g++"))]
    cxx = os.environ.get("CXX")
    if cxx:
        facts.append(_fact(f"CXX={cxx}", compiler(cxx)))
    return facts


def _host_facts() -> list[tuple[str, str]]:
    def cpu() -> str:
        info = _cpu_info()
        return f"{info.get('brand_raw', 'unknown')} ({info.get('arch_string_raw', platform.machine())})"

    def cores() -> str:
        import psutil

        usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        return (
            f"{psutil.cpu_count(logical=False)} physical, {psutil.cpu_count()} logical, {usable} usable by this process"
        )

    def simd() -> str:
        flags = set(_cpu_info().get("flags", []))
        return " ".join(flag for flag in _SIMD_FLAGS if flag in flags) or "none of " + " ".join(_SIMD_FLAGS)

    def memory() -> str:
        import psutil

        mem = psutil.virtual_memory()
        return f"{mem.total / 2**30:.1f} GiB total, {mem.available / 2**30:.1f} GiB available"

    return [_fact("cpu", cpu), _fact("cores", cores), _fact("simd", simd), _fact("ram", memory)]


def _op_facts() -> list[tuple[str, str]]:
    """Each op's state: prebuilt, cached, buildable (JIT on first use) or fallback (and why)."""

    def cache_dir() -> str:
        from slipstream.ops.builder import cache_root

        return str(cache_root())

    def op_state(name: str) -> Callable[[], str]:
        def get() -> str:
            from slipstream.ops import builder
            from slipstream.ops.specs import ALL_OPS

            status = builder.status(ALL_OPS[name])
            return f"{status.state}: {status.detail}"

        return get

    def cpu_adam_isa() -> str:
        from slipstream.ops import builder
        from slipstream.ops.specs import CPU_ADAM

        if builder.status(CPU_ADAM).state not in ("prebuilt", "cached"):
            return "unknown until the op is built"
        module = builder.load(CPU_ADAM)
        return module.isa() if module is not None else "unknown (op failed to load)"

    from slipstream.ops.specs import ALL_OPS  # imports no torch

    facts = [_fact("op cache", cache_dir)]
    disabled = os.environ.get("SLIPSTREAM_DISABLE_OPS")
    if disabled:
        facts.append(("SLIPSTREAM_DISABLE_OPS", disabled))
    facts += [_fact(f"op {name}", op_state(name)) for name in ALL_OPS]
    facts.append(_fact("cpu_adam kernel isa", cpu_adam_isa))
    return facts


@cache
def _cpu_info() -> dict[str, Any]:
    import cpuinfo  # about a second: it probes the CPU in a subprocess, so ask once

    return cpuinfo.get_cpu_info()


def _run(cmd: list[str]) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=True)
    return done.stdout or done.stderr
