"""The op builder: cache, build lock across processes, fast cached loads, fallbacks, report.

Most tests build a tiny op (pybind11 only, -O0: a few seconds) into a fresh cache directory; the
start-up test loads the real CPU Adam op from the ordinary cache (building it if needed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from slipstream.ops import builder

TINY_SOURCE = r"""
#include <pybind11/pybind11.h>
#include <string>
#ifndef SLIPSTREAM_OP_KEY
#define SLIPSTREAM_OP_KEY unkeyed
#endif
#define SS_STR2(x) #x
#define SS_STR(x) SS_STR2(x)
int add(int a, int b) { return a + b; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add", &add);
  m.def("build_key", [] { return std::string(SS_STR(SLIPSTREAM_OP_KEY)); });
}
"""

# Loads the tiny op (root and name from argv) and prints what happened as JSON.
LOADER = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    import torch
    start = time.perf_counter()
    from slipstream.ops import builder
    spec = builder.OpSpec(name=sys.argv[2], sources=("tiny.cpp",), include_dirs=(), root=Path(sys.argv[1]), cflags=("-O0",))
    module = builder.load(spec)
    elapsed = time.perf_counter() - start
    status = builder.loaded_status(spec)
    print(json.dumps({"state": status.state, "detail": status.detail, "seconds": elapsed,
                      "sum": module.add(2, 3) if module is not None else None}))
    """
)


def _has_toolchain() -> bool:
    spec = builder.OpSpec(name="probe", sources=())
    return builder._missing_tools(spec) is None


needs_toolchain = pytest.mark.skipif(not _has_toolchain(), reason="no C++ compiler or ninja")


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    root = tmp_path / "src"
    root.mkdir()
    (root / "tiny.cpp").write_text(TINY_SOURCE)
    cache = tmp_path / "cache"
    monkeypatch.setenv("SLIPSTREAM_OPS_CACHE", str(cache))
    monkeypatch.delenv("SLIPSTREAM_DISABLE_OPS", raising=False)
    name = f"slipstream_tiny_{os.getpid()}_{tmp_path.name[-8:]}".replace("-", "_")
    return root, name, cache


def _load_in_subprocesses(root: Path, name: str, count: int) -> list[dict]:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", LOADER, str(root), name], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(count)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


@needs_toolchain
def test_ranks_starting_together_build_once_then_load_from_cache_fast(tiny):
    root, name, cache = tiny
    results = _load_in_subprocesses(root, name, 4)
    assert sorted(r["state"] for r in results) == ["built", "cached", "cached", "cached"], results
    assert all(r["sum"] == 5 for r in results)
    [build_dir] = [p for p in cache.iterdir() if p.is_dir()]
    assert len(list(build_dir.glob(f"{name}*.so"))) == 1
    # A later start imports the finished library without ninja or setuptools.
    [again] = _load_in_subprocesses(root, name, 1)
    assert again["state"] == "cached", again  # imported from the cache: no ninja, no compiler


@needs_toolchain
def test_changed_source_gets_a_new_key_and_a_rebuild(tiny):
    root, name, cache = tiny
    spec = builder.OpSpec(name=name, sources=("tiny.cpp",), include_dirs=(), root=root, cflags=("-O0",))
    first = builder.op_key(spec)
    (root / "tiny.cpp").write_text(TINY_SOURCE.replace("a + b", "a + b + 0"))
    builder._op_key_cached.cache_clear()
    assert builder.op_key(spec) != first
    assert builder.status(spec).state == "buildable"


@needs_toolchain
def test_failed_build_warns_once_falls_back_and_is_not_retried(tiny):
    root, name, cache = tiny
    (root / "tiny.cpp").write_text(TINY_SOURCE.replace("return a + b;", "return a + undefined_name;"))
    script = LOADER + "\nbuilder.load(spec)\n"  # a second request must not warn again
    first = subprocess.run([sys.executable, "-c", script, str(root), name], capture_output=True, text=True, timeout=300)
    result = json.loads(first.stdout.strip().splitlines()[-1])
    assert result["state"] == "fallback" and result["sum"] is None
    assert "undefined_name" in result["detail"]
    warnings = [line for line in first.stderr.splitlines() if "WARNING" in line]
    assert len(warnings) == 1 and "SLIPSTREAM_BUILD_OPS=1" in warnings[0], first.stderr
    [log] = list(cache.glob("*/build_failed.txt"))
    assert "undefined_name" in log.read_text()
    [second] = _load_in_subprocesses(root, name, 1)
    assert second["state"] == "fallback" and "earlier build failed" in second["detail"]
    spec = builder.OpSpec(name=name, sources=("tiny.cpp",), include_dirs=(), root=root, cflags=("-O0",))
    assert builder.status(spec).state == "fallback"


def test_disabled_ops_fall_back_and_training_still_steps(tmp_path):
    code = textwrap.dedent(
        """
        import torch
        from slipstream.ops import builder
        from slipstream.ops.adam import CPUAdam, cpu_adam_available
        from slipstream.ops.specs import CPU_ADAM
        assert not cpu_adam_available()
        p = torch.nn.Parameter(torch.ones(10))
        opt = CPUAdam([p], lr=0.1)
        for _ in range(3):
            p.grad = torch.ones(10)
            opt.step()
        assert torch.allclose(p.detach(), torch.full((10,), 0.7), atol=1e-5), p
        print(builder.loaded_status(CPU_ADAM).detail)
        """
    )
    env = dict(os.environ, SLIPSTREAM_DISABLE_OPS="1", SLIPSTREAM_OPS_CACHE=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "SLIPSTREAM_DISABLE_OPS" in done.stdout
    assert len([line for line in done.stderr.splitlines() if "WARNING" in line]) == 1
    assert not any(tmp_path.iterdir())  # nothing was built


@needs_toolchain
def test_prebuilt_op_is_used_only_when_its_key_matches(tiny, monkeypatch):
    root, name, cache = tiny
    spec = builder.OpSpec(name=name, sources=("tiny.cpp",), include_dirs=(), root=root, cflags=("-O0",))
    module, how = builder.build(spec)
    assert how == "built" and module.build_key() == builder.op_key(spec)
    library = (
        builder.build_dir(spec) / json.loads((builder.build_dir(spec) / "slipstream_op.json").read_text())["library"]
    )
    monkeypatch.setattr(builder, "_prebuilt_path", lambda _spec: library)
    assert builder.status(spec).state == "prebuilt"
    other = builder.OpSpec(name=name, sources=("tiny.cpp",), include_dirs=(), root=root, cflags=("-DX=1",))
    assert builder._import_prebuilt(other) is None  # built from other inputs: ignored


def test_cpu_adam_loads_from_cache_in_a_new_process():
    from slipstream.ops.specs import CPU_ADAM

    if builder.status(CPU_ADAM).state == "fallback":
        pytest.skip(f"CPU Adam cannot be built here: {builder.status(CPU_ADAM).detail}")
    start = time.perf_counter()
    assert builder.load(CPU_ADAM) is not None
    print(f"CPU Adam {builder.loaded_status(CPU_ADAM).state} after {time.perf_counter() - start:.1f} s")
    code = textwrap.dedent(
        """
        import time, torch
        start = time.perf_counter()
        from slipstream.ops.adam import cpu_adam_available
        from slipstream.ops import builder
        from slipstream.ops.specs import CPU_ADAM
        assert cpu_adam_available()
        print(time.perf_counter() - start, builder.loaded_status(CPU_ADAM).state)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=120).stdout
    _, state = out.split()
    assert state in ("cached", "prebuilt"), out  # no build in a new process: the cached library is imported


def test_report_lists_each_op_status(capsys):
    from slipstream.cli import main

    assert main(["report"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "--- compiled ops" in lines
    for op in ("cpu_adam", "fused_adam"):
        line = next(line for line in lines if line.startswith(f"op {op} "))
        state = line.split(". ", 1)[1].strip()
        assert state.split(":")[0] in ("prebuilt", "cached", "buildable", "fallback"), line
    if not _torch_cuda():
        assert any(line.startswith("op fused_adam ") and "no CUDA" in line for line in lines)


def _torch_cuda() -> bool:
    import torch

    return bool(torch.version.cuda)
