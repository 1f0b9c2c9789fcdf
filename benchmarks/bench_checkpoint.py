"""Checkpoint save/load time and the training stall of sync vs async saves, beside torch.save and DeepSpeed.

    python benchmarks/bench_checkpoint.py [--layers 4] [--embd 1024] [--reps 4] [--dir /tmp/x]
                                          [--deepspeed-python /tmp/dsvenv/bin/python]

One process (world size 1, ZeRO stage 0, fp32, AdamW): a GPT-2 of ``--layers`` x ``--embd``
(defaults: 59M parameters, 236 MB of weights, 708 MB of weights + Adam state). Per repetition:

* slipstream sync ``save_checkpoint`` (every file fsynced, CRC-32 computed) and ``load_checkpoint``;
* slipstream async save: the *stall* (the ``save_checkpoint`` call, plus the copy of what is not
  yet written when the next optimizer step begins), the time until the background write is
  committed, the step time while it runs, and the worst case: an optimizer step right after the
  call (everything still unwritten is copied then);
* ``torch.save`` of ``{model, optimizer}`` state dicts (no fsync, as DeepSpeed does; also with an
  fsync), and ``torch.load(weights_only=True)``;
* DeepSpeed 0.19.8 ``save_checkpoint``/``load_checkpoint`` (same model and optimizer, stage 0), in
  its own venv, in separate processes interleaved with ours (A B A B).

Medians over repetitions; the page cache is warm for loads (the machine is shared, we cannot drop it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SEQ, VOCAB = 64, 8192


def _model(layers: int, embd: int):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_layer=layers,
        n_embd=embd,
        n_head=8,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def _config() -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}},
        "zero_optimization": {"stage": 0},
    }


def _fsync_tree(path: Path) -> None:
    for file in [path] if path.is_file() else path.rglob("*"):
        if file.is_file():
            with open(file, "rb+") as f:
                os.fsync(f.fileno())


def _slipstream(args: argparse.Namespace, reps: int, directory: Path) -> dict[str, list[float]]:
    import torch

    import slipstream

    torch.set_num_threads(2)
    engine = slipstream.initialize(_model(args.layers, args.embd), _config())
    tokens = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(0))

    def step() -> float:
        start = time.perf_counter()
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        return time.perf_counter() - start

    for _ in range(2):
        step()
    out: dict[str, list[float]] = {
        k: []
        for k in (
            "sync_save",
            "load",
            "async_stall",
            "async_total",
            "async_fence_now",
            "step_idle",
            "step_during_async",
            "torch_save",
            "torch_save_fsync",
            "torch_load",
        )
    }
    for _ in range(reps):
        out["step_idle"].append(step())
        engine.checkpoints.config.async_save = False
        start = time.perf_counter()
        engine.save_checkpoint(directory, tag="sync")
        out["sync_save"].append(time.perf_counter() - start)
        start = time.perf_counter()
        engine.load_checkpoint(directory, tag="sync")
        out["load"].append(time.perf_counter() - start)

        engine.checkpoints.config.async_save = True
        engine.save_checkpoint(directory, tag="async")
        out["step_during_async"].append(step())  # trains while the write runs; fences before its optimizer step
        engine.checkpoints.wait()
        out["async_stall"].append(engine.checkpoints.last_stall_s)  # the save call + the fence
        out["async_total"].append(engine.checkpoints.last_write_s)
        # Worst case: an optimizer step right after the save call copies everything not yet written.
        engine.save_checkpoint(directory, tag="async")
        engine.checkpoints.before_update()
        out["async_fence_now"].append(engine.checkpoints.last_stall_s)
        engine.checkpoints.wait()

        state = {"model": engine.module.state_dict(), "optimizer": engine.optimizer.state_dict()}
        target = directory / "torch_save.pt"
        start = time.perf_counter()
        torch.save(state, target)
        out["torch_save"].append(time.perf_counter() - start)
        _fsync_tree(target)
        out["torch_save_fsync"].append(time.perf_counter() - start)
        start = time.perf_counter()
        torch.load(target, weights_only=True)
        out["torch_load"].append(time.perf_counter() - start)
        target.unlink()
    engine.close()
    return out


_DEEPSPEED_SCRIPT = r"""
import json, os, shutil, statistics, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import torch, deepspeed
torch.set_num_threads(2)
from benchmarks.bench_checkpoint import _model, _config, SEQ, VOCAB
layers, embd, reps, directory = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5])
config = _config()
config["optimizer"]["params"].pop("torch_adam")
model = _model(layers, embd)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config={k: v for k, v in config.items() if k != "optimizer"})
tokens = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(0))
for _ in range(2):
    loss = engine(input_ids=tokens, labels=tokens).loss; engine.backward(loss); engine.step()
out = {"save": [], "load": []}
for _ in range(reps):
    start = time.perf_counter(); engine.save_checkpoint(str(directory), tag="ds"); out["save"].append(time.perf_counter() - start)
    start = time.perf_counter(); engine.load_checkpoint(str(directory), tag="ds"); out["load"].append(time.perf_counter() - start)
print("RESULT " + json.dumps(out), flush=True)
"""


def _deepspeed(python: str, args: argparse.Namespace, reps: int, directory: Path) -> dict[str, list[float]] | None:
    from benchmarks.common import free_port

    env = {
        **os.environ,
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "PYTHONPATH": str(ROOT),
    }
    done = subprocess.run(
        [python, "-c", _DEEPSPEED_SCRIPT, str(ROOT), str(args.layers), str(args.embd), str(reps), str(directory)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    print(f"DeepSpeed run failed (exit {done.returncode}):\n{done.stderr[-3000:]}", file=sys.stderr)
    return None


def _run_ours(args: argparse.Namespace, reps: int, directory: Path) -> dict[str, list[float]]:
    """Our repetitions in a fresh process (so both sides pay the same page-cache and allocator history)."""
    from benchmarks.common import free_port

    env = {
        **os.environ,
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "PYTHONPATH": str(ROOT),
        "SLIPSTREAM_LOG_LEVEL": "warning",
    }
    code = (
        "import json, sys; from pathlib import Path; import argparse; from benchmarks.bench_checkpoint import _slipstream; "
        f"a = argparse.Namespace(layers={args.layers}, embd={args.embd}); "
        f"print('RESULT ' + json.dumps(_slipstream(a, {reps}, Path({str(directory)!r}))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1800, check=False
    )
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"slipstream run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=4, help="repetitions per side (split over 2 alternating rounds)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--deepspeed-python", default="/tmp/dsvenv/bin/python")
    args = parser.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-ckpt-"))
    ours: dict[str, list[float]] = {}
    peer: dict[str, list[float]] = {}
    has_ds = Path(args.deepspeed_python).is_file()
    half = max(args.reps // 2, 1)
    for _round in range(2):  # A B A B
        for key, values in _run_ours(args, half, root / "slipstream").items():
            ours.setdefault(key, []).extend(values)
        shutil.rmtree(root / "slipstream", ignore_errors=True)
        if has_ds:
            result = _deepspeed(args.deepspeed_python, args, half, root / "deepspeed")
            for key, values in (result or {}).items():
                peer.setdefault(key, []).extend(values)
            shutil.rmtree(root / "deepspeed", ignore_errors=True)
    med = {k: statistics.median(v) for k, v in ours.items()}
    import torch  # noqa: F401 - only for the parameter count below

    numel = sum(p.numel() for p in _model(args.layers, args.embd).parameters())
    print(
        f"model: GPT-2 {args.layers} layers x {args.embd}: {numel / 1e6:.1f}M parameters, {numel * 4 / 1e6:.0f} MB weights, "
        f"{numel * 12 / 1e6:.0f} MB with AdamW state; medians of {len(ours['sync_save'])} repetitions"
    )
    rows = [
        ("slipstream sync save (fsync, CRC-32)", med["sync_save"]),
        ("slipstream async save: training stall", med["async_stall"]),
        ("  same, optimizer step right after the call", med["async_fence_now"]),
        ("slipstream async save: until committed", med["async_total"]),
        ("slipstream load", med["load"]),
        ("torch.save {model, optimizer}", med["torch_save"]),
        ("torch.save + fsync", med["torch_save_fsync"]),
        ("torch.load(weights_only=True)", med["torch_load"]),
    ]
    if peer:
        rows += [
            ("DeepSpeed save_checkpoint", statistics.median(peer["save"])),
            ("DeepSpeed load_checkpoint", statistics.median(peer["load"])),
        ]
    for name, seconds in rows:
        print(f"  {name:<42} {seconds * 1e3:8.0f} ms")
    print(
        f"  step time idle / while the async save writes: {med['step_idle'] * 1e3:.0f} / {med['step_during_async'] * 1e3:.0f} ms"
    )
    print(
        f"async stall / sync save = {med['async_stall'] / med['sync_save']:.3f} (target <= 0.10); "
        f"worst case (step right after the call) {med['async_fence_now'] / med['sync_save']:.3f}"
    )
    print(
        f"sync save / torch.save = {med['sync_save'] / med['torch_save']:.2f}; sync save / torch.save+fsync = "
        f"{med['sync_save'] / med['torch_save_fsync']:.2f}"
    )
    if peer:
        print(
            f"sync save / DeepSpeed save = {med['sync_save'] / statistics.median(peer['save']):.2f}; "
            f"load / DeepSpeed load = {med['load'] / statistics.median(peer['load']):.2f}"
        )
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
