"""Build compiled ops with ninja, cache them on disk, and never let a missing build stop training.

An op is an :class:`OpSpec` (sources under ``csrc/`` and flags). :func:`load` returns its Python
module, trying in order:

1. *prebuilt* — compiled at install time (``SLIPSTREAM_BUILD_OPS=1 pip install .``) into
   ``slipstream/ops/_prebuilt/``, used when its build key matches;
2. *cached* — a finished JIT build under the cache root, imported directly (a few milliseconds;
   ``torch.utils.cpp_extension.load`` would re-run ninja and import setuptools, ~0.3 s);
3. *built* — compiled now with ``torch.utils.cpp_extension.load`` into the cache, under a file lock
   so the ranks of a node build once and the others wait and load the result.

When none of these works (``SLIPSTREAM_DISABLE_OPS=1``, no compiler, a failed build) it returns
``None`` and logs one warning line naming the fix; callers then use their pure-PyTorch path. A
failed build is recorded in the cache and not retried with the same inputs until
``python -m slipstream.ops.build`` is run.

[Note: the build key] The cache directory of an op is named by a hash of everything that changes
the binary: torch version and C++ ABI, Python version, machine, compiler version, flags, CUDA
architectures, and the contents of the sources and headers. Ops are compiled for the baseline ISA
and pick AVX2/AVX-512 at run time, so one cache is valid on every x86-64 host sharing it.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType

from slipstream.errors import SlipstreamError
from slipstream.utils.logging import get_logger

logger = get_logger(__name__)

BUILD_HINT = "SLIPSTREAM_BUILD_OPS=1 pip install --no-build-isolation . (or python -m slipstream.ops.build)"
_MARKER = "slipstream_op.json"
_FAILED = "build_failed.txt"


@dataclass(frozen=True)
class OpSpec:
    """One compiled op: the extension module ``name`` built from ``sources`` (relative to csrc/)."""

    name: str
    sources: tuple[str, ...]
    cflags: tuple[str, ...] = ()
    ldflags: tuple[str, ...] = ()
    cuda: bool = False  # needs a CUDA build of torch and nvcc
    cuda_cflags: tuple[str, ...] = ()
    include_dirs: tuple[str, ...] = ("includes",)
    root: Path | None = None  # csrc root; None: the package's (or the checkout's)


@dataclass(frozen=True)
class OpStatus:
    """``state`` is one of prebuilt, cached, built, buildable, fallback; ``detail`` says why/where."""

    state: str
    detail: str


class OpBuildError(SlipstreamError, RuntimeError):
    pass


# ------------------------------------------------------------------------------------ locations


def csrc_root() -> Path:
    """The C++/CUDA sources: shipped inside the package, or the checkout's top-level csrc/."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "csrc", here.parent.parent / "csrc"):
        if (candidate / "includes").is_dir():
            return candidate
    raise OpBuildError(f"no csrc/ directory next to {here} or in the source checkout; reinstall slipstream")


def cache_root() -> Path:
    configured = os.environ.get("SLIPSTREAM_OPS_CACHE")
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "slipstream" / "ops"


def build_dir(spec: OpSpec) -> Path:
    return cache_root() / f"{spec.name}-{op_key(spec)}"


def op_sources(spec: OpSpec) -> list[Path]:
    root = spec.root or csrc_root()
    return [root / source for source in spec.sources]


def op_include_dirs(spec: OpSpec) -> list[Path]:
    root = spec.root or csrc_root()
    return [root / include for include in spec.include_dirs]


# ----------------------------------------------------------------------------------------- key


@cache
def _tool_version(*cmd: str) -> str:
    try:
        done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"unavailable ({err})"
    lines = (done.stdout or done.stderr).strip().splitlines()
    return lines[-1] if "nvcc" in cmd[0] else (lines[0] if lines else "unknown")


def compiler() -> str:
    return os.environ.get("CXX", "c++")


def nvcc_path() -> str | None:
    found = shutil.which("nvcc")
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    if found is None and os.path.isfile(os.path.join(home, "bin", "nvcc")):
        found = os.path.join(home, "bin", "nvcc")
    return found


def _cuda_archs() -> str:
    configured = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if configured:
        return configured
    import torch

    if not torch.cuda.is_available():
        return "none"
    return ";".join(
        sorted({"{}.{}".format(*torch.cuda.get_device_capability(i)) for i in range(torch.cuda.device_count())})
    )


def cflags(spec: OpSpec) -> list[str]:
    return ["-O3", *spec.cflags]


@cache
def _op_key_cached(spec: OpSpec) -> str:
    import torch

    digest = hashlib.sha256()
    facts = [
        torch.__version__,
        str(torch.version.cuda),
        str(int(torch._C._GLIBCXX_USE_CXX11_ABI)),
        sys.implementation.cache_tag,
        platform.machine(),
        _tool_version(compiler(), "--version"),
        " ".join(cflags(spec)),
        " ".join(spec.ldflags),
    ]
    if spec.cuda:
        nvcc = nvcc_path()
        facts += [_tool_version(nvcc, "--version") if nvcc else "no nvcc", _cuda_archs(), " ".join(spec.cuda_cflags)]
    for fact in facts:
        digest.update(fact.encode() + b"\0")
    files = list(op_sources(spec))
    for include in op_include_dirs(spec):
        files += sorted(p for p in include.rglob("*") if p.is_file())
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return "k" + digest.hexdigest()[:16]


def op_key(spec: OpSpec) -> str:
    return _op_key_cached(spec)


# ------------------------------------------------------------------------------------- loading

_loaded: dict[OpSpec, tuple[ModuleType | None, OpStatus]] = {}


def load(spec: OpSpec) -> ModuleType | None:
    """The op's module, building it if needed; ``None`` (after one warning) means use the fallback."""
    if spec not in _loaded:
        _loaded[spec] = _load(spec)
        module, status = _loaded[spec]
        if module is None and status.state == "fallback":
            logger.warning(
                "op %s unavailable (%s); using the PyTorch fallback. To build it: %s",
                spec.name,
                status.detail,
                BUILD_HINT,
            )
    return _loaded[spec][0]


def loaded_status(spec: OpSpec) -> OpStatus | None:
    """How ``load`` resolved ``spec`` in this process, or None if it was not asked yet."""
    return _loaded[spec][1] if spec in _loaded else None


def _load(spec: OpSpec) -> tuple[ModuleType | None, OpStatus]:
    blocked = _blocked_reason(spec)
    if blocked:
        return None, OpStatus("fallback", blocked)
    try:
        module = _import_prebuilt(spec)
        if module is not None:
            return module, OpStatus("prebuilt", str(module.__file__))
        module = _import_cached(spec)
        if module is not None:
            return module, OpStatus("cached", str(build_dir(spec)))
        module, state = build(spec)
        return module, OpStatus(state, str(build_dir(spec)))
    except Exception as err:  # a broken op must never stop training: report and fall back
        return None, OpStatus("fallback", _one_line(err))


def _blocked_reason(spec: OpSpec) -> str | None:
    if os.environ.get("SLIPSTREAM_DISABLE_OPS", "") not in ("", "0"):
        return "disabled by SLIPSTREAM_DISABLE_OPS"
    if spec.cuda:
        import torch

        if not torch.version.cuda:
            return "this torch build has no CUDA"
    return None


def _import_so(name: str, path: Path) -> ModuleType:
    import torch  # noqa: F401 - the extension links against libtorch, which must be loaded first

    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise OpBuildError(f"cannot import {path}")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def _prebuilt_path(spec: OpSpec) -> Path | None:
    folder = Path(__file__).resolve().parent / "_prebuilt"
    matches = sorted(folder.glob(f"{spec.name}.*.so")) + sorted(folder.glob(f"{spec.name}.*.pyd"))
    return matches[0] if matches else None


def _import_prebuilt(spec: OpSpec) -> ModuleType | None:
    path = _prebuilt_path(spec)
    if path is None:
        return None
    module = _import_so(spec.name, path)
    if module.build_key() != op_key(spec):
        logger.info("prebuilt op %s does not match this environment or its sources; ignoring it", spec.name)
        return None
    return module


def _read_marker(spec: OpSpec) -> dict | None:
    try:
        marker = json.loads((build_dir(spec) / _MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if marker.get("key") == op_key(spec) else None


def _import_cached(spec: OpSpec) -> ModuleType | None:
    marker = _read_marker(spec)
    if marker is None:
        return None
    return _import_so(spec.name, build_dir(spec) / marker["library"])


@contextlib.contextmanager
def _build_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        try:
            import fcntl
        except ImportError:  # Windows: no lock; torch's own baton still serializes the ninja step
            yield
            return
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def build(spec: OpSpec, *, retry_failed: bool = False) -> tuple[ModuleType, str]:
    """Compile ``spec`` into the cache (or take another process's finished build).

    Returns the module and ``"built"`` or ``"cached"``; raises :class:`OpBuildError`.
    """
    target = build_dir(spec)
    with _build_lock(target.with_name(target.name + ".lock")):
        module = _import_cached(spec)  # another rank may have finished while we waited
        if module is not None:
            return module, "cached"
        failed = target / _FAILED
        if failed.exists() and not retry_failed:
            raise OpBuildError(f"an earlier build failed (log: {failed})")
        failed.unlink(missing_ok=True)
        target.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        try:
            module = _compile(spec, target)
        except Exception as err:
            failed.write_text(f"{type(err).__name__}: {err}\n")
            raise OpBuildError(f"build failed: {_first_error(str(err))} (log: {failed})") from err
        seconds = time.perf_counter() - start
        library = Path(str(module.__file__)).name
        marker = {"key": op_key(spec), "library": library, "seconds": round(seconds, 2), "built": time.time()}
        tmp = target / (_MARKER + ".tmp")
        tmp.write_text(json.dumps(marker))
        tmp.replace(target / _MARKER)  # the marker appears only once the library is complete
    logger.info("built op %s in %.1f s (%s)", spec.name, seconds, target)
    return module, "built"


def _compile(spec: OpSpec, target: Path) -> ModuleType:
    _ensure_ninja_on_path()
    from torch.utils import cpp_extension

    key_flag = f"-DSLIPSTREAM_OP_KEY={op_key(spec)}"
    return cpp_extension.load(
        name=spec.name,
        sources=[str(p) for p in op_sources(spec)],
        extra_include_paths=[str(p) for p in op_include_dirs(spec)],
        extra_cflags=[*cflags(spec), key_flag],
        extra_ldflags=list(spec.ldflags),
        extra_cuda_cflags=[*spec.cuda_cflags, key_flag] if spec.cuda else None,
        build_directory=str(target),
        with_cuda=spec.cuda,
        verbose=False,
    )


def _ensure_ninja_on_path() -> None:
    if shutil.which("ninja"):
        return
    candidates = [os.path.dirname(sys.executable)]
    with contextlib.suppress(ImportError):
        import ninja

        candidates.insert(0, ninja.BIN_DIR)
    for folder in candidates:
        if os.path.isfile(os.path.join(folder, "ninja")):
            os.environ["PATH"] = folder + os.pathsep + os.environ.get("PATH", "")
            return


def _first_error(output: str) -> str:
    """The compiler's first error line (the rest of a failed build's output is in its log)."""
    for line in output.splitlines():
        if "error:" in line:
            return " ".join(line.split())[:300]
    return " ".join(output.split())[:300]


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    text = text if len(text) < 300 else text[:297] + "..."
    return f"{type(err).__name__}: {text}"


# -------------------------------------------------------------------------------------- status


def status(spec: OpSpec) -> OpStatus:
    """What ``load`` would do, without building (for ``slipstream report``)."""
    if spec in _loaded:
        return _loaded[spec][1]
    blocked = _blocked_reason(spec)
    if blocked:
        return OpStatus("fallback", blocked)
    try:
        path = _prebuilt_path(spec)
        if path is not None and _import_prebuilt(spec) is not None:
            return OpStatus("prebuilt", str(path))
        marker = _read_marker(spec)
        if marker is not None:
            return OpStatus("cached", f"{build_dir(spec)} (built in {marker.get('seconds', '?')} s)")
        failed = build_dir(spec) / _FAILED
        if failed.exists():
            return OpStatus(
                "fallback", f"an earlier build failed (log: {failed}); retry: python -m slipstream.ops.build"
            )
        missing = _missing_tools(spec)
        if missing:
            return OpStatus("fallback", f"cannot build: {missing}")
        return OpStatus("buildable", f"JIT build on first use into {build_dir(spec)}")
    except Exception as err:
        return OpStatus("fallback", _one_line(err))


def _missing_tools(spec: OpSpec) -> str | None:
    _ensure_ninja_on_path()
    if shutil.which(compiler()) is None:
        return f"no C++ compiler ({compiler()} not on PATH)"
    if shutil.which("ninja") is None:
        return "ninja not found (pip install ninja)"
    if spec.cuda and nvcc_path() is None:
        return "nvcc not found (set CUDA_HOME)"
    return None
