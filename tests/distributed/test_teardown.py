"""Exit without abort: at exit slipstream finishes in-flight collectives, closes its rings and destroys the groups
while the interpreter is whole (slipstream/comm/teardown.py, [Note: no abort at exit]).

The abort itself is rare (benchmarks/bench_teardown.py counts it over 50 start/stop cycles); what is tested
here is the mechanism it rests on, on a real 2-rank launch: a script that returns with its own ``async_op``
all-reduce and one of slipstream's collectives still in flight exits 0, and an ``atexit`` handler that runs
after slipstream's finds the process groups destroyed; a script that dies of an exception keeps them (its
peers may never join the queued work, so destroying could wait for the timeout).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import atexit, sys
import torch.distributed as dist

def after_slipstream():  # registered before slipstream is imported, so it runs after slipstream's handler
    from slipstream.comm.process import PROCESS
    pending = len(PROCESS.watch_pending)  # completion callbacks not yet run (the user's all-reduce's)
    print(f"AFTER rank={RANK} initialized={dist.is_initialized()} pending={pending}", flush=True)

atexit.register(after_slipstream)
import torch
import slipstream
from slipstream import comm

slipstream.init_distributed()
RANK = dist.get_rank()
engine = slipstream.initialize(torch.nn.Linear(8, 8), {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
                                                      "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
engine.backward(engine(torch.randn(2, 8)).sum())
engine.step()
mine = dist.all_reduce(torch.ones(4096), async_op=True)         # the user's, never waited for
ours = comm.all_reduce(torch.ones(4096), tag="left in flight")  # slipstream's, never waited for
if sys.argv[1] == "raise":
    raise ValueError("the script failed")
"""


def _launch(tmp_path: Path, mode: str) -> subprocess.CompletedProcess:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SLIPSTREAM_ACCELERATOR": "cpu"}
    return subprocess.run(
        [sys.executable, "-m", "slipstream.cli", "run", "--nproc_per_node", "2", str(script), mode],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_a_script_that_returns_with_collectives_in_flight_exits_cleanly_with_its_groups_destroyed(
    tmp_path: Path,
) -> None:
    done = _launch(tmp_path, "return")
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "terminate called" not in output, output[-3000:]
    for rank in (0, 1):
        assert f"AFTER rank={rank} initialized=False pending=0" in output, output[-3000:]


def test_a_script_that_raises_keeps_its_groups_and_reports_its_error(tmp_path: Path) -> None:
    done = _launch(tmp_path, "raise")
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert "ValueError: the script failed" in output, output[-3000:]
    assert "initialized=True" in output, output[-3000:]
