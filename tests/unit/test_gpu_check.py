"""scripts/gpu_check.sh in its dry mode: runs end to end without a GPU, lists the CUDA tier, exits 0."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_dry_run_lists_every_cuda_test_and_exits_0() -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry", "--no-setup"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    listed = [line for line in done.stdout.splitlines() if line.startswith("needs a GPU: tests/")]
    names = {line.rsplit("::", 1)[-1].split("[")[0] for line in listed}
    assert {
        "test_fused_adam_matches_torch_fused_adamw",
        "test_zero_stages_match_pytorch_on_one_gpu",
        "test_zero_stages_on_every_gpu",
        "test_offload_with_pinned_memory",
        "test_cpu_checkpointing_lowers_device_memory_on_cuda",
    } <= names, done.stdout
    assert "needs a GPU: benchmarks/bench_gpu.py" in done.stdout
    assert f"({len(listed)} CUDA tests listed)" in done.stdout


def test_unknown_argument_is_refused() -> None:
    done = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--fast"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "unknown argument --fast" in done.stderr
