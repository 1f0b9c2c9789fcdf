"""Kill a saving process at every file-system step of the save protocol in turn; check what is left.

Run as ``python -m tests.unit.checkpoint_killpoint_worker WORKDIR`` (by test_checkpoint_killpoints.py).
For each scenario (new or existing tag, sync or async, with or without an atomic exchange) a child
first counts the steps of one save: each ``fsync``, ``rename``/``replace``, ``renameat2`` exchange
and each file opened for writing (``latest`` among them). Then, for every step k, a child forked
from this process (torch already imported) starts from the same directory, saves, and SIGKILLs
itself just before step k. After each kill this process checks that ``latest`` resolves to a
complete checkpoint whose every tensor and tree reads back (checksums verified), that it is the old
or the new one, and that the next save's recovery leaves no ``.tmp-``/``.trash-`` directory.
One JSON line per kill point.
"""

from __future__ import annotations

import builtins
import json
import os
import shutil
import signal
import sys
import tempfile
import warnings
from pathlib import Path

import torch

torch.set_num_threads(1)
os.environ.setdefault("SLIPSTREAM_ACCELERATOR", "cpu")

import torch.distributed as dist

import slipstream
from slipstream.engine.checkpoint import writer
from slipstream.engine.checkpoint.reader import CheckpointReader, resolve
from slipstream.engine.checkpoint.verify import verify

torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # its first construction imports torch._dynamo (seconds)
_ = slipstream.initialize  # import the engine here, once, not in each forked child (a second per kill point)

SCENARIOS = {  # name: (tag exists already, async, atomic exchange available)
    "new-sync": (False, False, True),
    "new-async": (False, True, True),
    "existing-sync": (True, False, True),
    "existing-async": (True, True, True),
    "existing-sync-no-exchange": (True, False, False),
}
TAG, OLD_STEPS, NEW_STEPS = "last", 1, 2


def _engine(async_save: bool) -> object:
    store = tempfile.mktemp(prefix="slipstream-kill-store-")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    config = {
        "train_batch_size": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "checkpoint": {"async": async_save},
    }
    return slipstream.initialize(model, config)


def _step(engine: object) -> None:
    loss = engine(torch.randn(2, 8)).pow(2).mean()
    engine.backward(loss)
    engine.step()


def _instrument(kill_at: int | None, counter: list[int]) -> None:
    """Count (and at ``kill_at``, die before) each file-system step of the protocol."""

    def hook(fn: object) -> object:
        def wrapped(*args: object, **kwargs: object) -> object:
            counter[0] += 1
            if kill_at is not None and counter[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return fn(*args, **kwargs)

        return wrapped

    os.fsync = hook(os.fsync)
    os.replace = hook(os.replace)
    os.rename = hook(os.rename)
    writer._exchange = hook(writer._exchange)
    real_open = builtins.open

    def open_hook(file: object, mode: str = "r", *args: object, **kwargs: object) -> object:
        if "w" in mode and "slipstream-kill-" in str(file):
            return hook(real_open)(file, mode, *args, **kwargs)
        return real_open(file, mode, *args, **kwargs)

    builtins.open = open_hook


def _child(save_dir: Path, existing: bool, async_save: bool, exchange: bool, kill_at: int | None, report: int) -> None:
    engine = _engine(async_save)
    _step(engine)
    if existing:
        engine.save_checkpoint(save_dir, tag=TAG)
        engine.close()
    _step(engine)
    if not exchange:
        writer._exchange = lambda a, b: False
    counter = [0]
    _instrument(kill_at, counter)
    engine.save_checkpoint(save_dir, tag=TAG)
    engine.close()
    os.write(report, f"{counter[0]}\n".encode())
    os._exit(0)


def _run(save_dir: Path, scenario: tuple[bool, bool, bool], kill_at: int | None) -> int | None:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            _child(save_dir, *scenario, kill_at, write)
        finally:
            os._exit(1)
    os.close(write)
    with os.fdopen(read) as f:
        out = f.read().strip()
    _, status = os.waitpid(pid, 0)
    if kill_at is None:
        assert status == 0 and out, f"the counting run failed (status {status})"
        return int(out)
    killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert killed, f"kill point {kill_at} was never reached (status {status})"
    return None


def _check(save_dir: Path, existing: bool) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = resolve(save_dir, None)
    if path is None:
        assert not existing, "the previous checkpoint is gone"
        return {"loaded": None}
    reader = CheckpointReader(path, verify_checksums=True)
    verify(reader)
    steps = reader.manifest["global_steps"]
    assert steps in ((OLD_STEPS, NEW_STEPS) if existing else (NEW_STEPS,)), steps
    writer.recover(save_dir, "another-tag")  # what the next save does first
    left = sorted(p.name for p in save_dir.iterdir() if p.name.startswith((".tmp-", ".trash-")) and p.is_dir())
    assert not left, f"stale directories after recovery: {left}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = resolve(save_dir, None)
    assert again is not None and CheckpointReader(again).manifest["global_steps"] == steps
    return {"loaded": path.name, "global_steps": steps}


def main() -> None:
    work = Path(sys.argv[1])
    for name, scenario in SCENARIOS.items():
        probe = work / f"slipstream-kill-{name}-count"
        steps = _run(probe, scenario, None)
        assert steps is not None and steps > 0
        for k in range(1, steps + 1):
            save_dir = work / f"slipstream-kill-{name}-{k}"
            _run(save_dir, scenario, k)
            result = _check(save_dir, scenario[0])
            print(json.dumps({"scenario": name, "kill_before_step": k, "steps": steps, **result}), flush=True)
            shutil.rmtree(save_dir)


if __name__ == "__main__":
    main()
