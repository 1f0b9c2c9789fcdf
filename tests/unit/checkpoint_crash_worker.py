"""Kill a process that is saving checkpoints with SIGKILL, again and again; check what it leaves behind.

Run as ``python -m tests.unit.checkpoint_crash_worker SAVE_DIR TRIALS SEED`` (by
test_checkpoint_crash.py). Torch is imported once; each trial forks a child that initializes an
engine (auto-resuming from SAVE_DIR), then trains and saves in a loop (odd trials: async saves),
reporting every checkpoint it knows is committed. The parent kills it at a random moment, then
checks that ``latest`` loads (checksums verified, every tensor read) and that the last checkpoint
the child reported still exists. One JSON line per trial on stdout.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch

torch.set_num_threads(1)
os.environ.setdefault("SLIPSTREAM_ACCELERATOR", "cpu")

import torch.distributed as dist

import slipstream
from slipstream.engine.checkpoint.reader import CheckpointReader, latest_tag
from slipstream.engine.initialize import initialize  # noqa: F401 - imported once, before forking

torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # its first construction imports torch._dynamo (seconds)


def _child(save_dir: Path, trial: int, report: int) -> None:
    store = tempfile.mktemp(prefix="slipstream-crash-store-")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    torch.manual_seed(trial)
    model = torch.nn.Sequential(*(torch.nn.Linear(384, 384) for _ in range(6)))  # ~0.9M parameters, ~14 MB saved
    config = {
        "train_batch_size": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 1},
        "checkpoint": {"save_dir": str(save_dir), "auto_resume": True, "keep_last_n": 2, "async": trial % 2 == 1},
    }
    engine = slipstream.initialize(model, config)
    out = os.fdopen(report, "w", buffering=1)
    pending = None
    while True:
        loss = engine(torch.randn(4, 384)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        started = time.perf_counter()
        path = engine.save_checkpoint(save_dir)  # waits for the previous (async) save first
        if pending is not None:
            out.write(json.dumps({"committed": pending, "save_s": time.perf_counter() - started}) + "\n")
        pending = Path(path).name
        if not engine.checkpoints.config.async_save:
            out.write(json.dumps({"committed": pending, "save_s": time.perf_counter() - started}) + "\n")
            pending = None


def _verify(save_dir: Path) -> str:
    tag = latest_tag(save_dir)
    assert tag is not None, "latest is missing"
    reader = CheckpointReader(save_dir / tag, verify_checksums=True)
    for name in reader.manifest["parameters"]:
        reader.full_param(name)
    reader.common()
    return tag


def main() -> None:
    save_dir, trials, seed = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    rng = random.Random(seed)
    for trial in range(trials):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: never returns
            os.close(read)
            try:
                _child(save_dir, trial, write)
            finally:
                os._exit(1)
        os.close(write)
        reports = os.fdopen(read)
        first = json.loads(reports.readline() or "{}")  # the child has committed at least one checkpoint
        if "committed" not in first:
            os.waitpid(pid, 0)
            raise RuntimeError(f"trial {trial}: the child died before its first checkpoint")
        delay = rng.uniform(0.0, 3.0 * max(first["save_s"], 0.02))
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        committed = [first["committed"]] + [json.loads(line)["committed"] for line in reports]
        reports.close()
        partial = sorted(p.name for p in save_dir.iterdir() if p.name.startswith(".tmp-"))
        latest = _verify(save_dir)
        last = committed[-1]
        assert (save_dir / last / "manifest.json").is_file(), (
            f"trial {trial}: the last committed checkpoint {last} was lost"
        )
        print(
            json.dumps(
                {"trial": trial, "delay_s": delay, "latest": latest, "last_committed": last, "partial": partial}
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
