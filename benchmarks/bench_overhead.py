"""Host overhead per step: a launch-bound model swept over its number of parameter tensors, Slipstream's ZeRO
stages against torch DDP and DeepSpeed (issue 50).

    python benchmarks/bench_overhead.py [--tensors 10 100 1000 10000] [--worlds 1 2] [--stages 0 1 2 3 2+cpu 3+cpu]
                                        [--rounds 2] [--steps 10] [--profile] [--deepspeed-python /tmp/dsvenv/bin/python]

The model is a chain of ``Linear(8, 8)`` layers (two tensors each) on a 4 × 8 batch: its arithmetic is nothing,
so a step is what the host does around it — autograd's nodes (the same for everyone), per-parameter hooks,
bookkeeping, copies, collectives and optimizer launches. Every framework uses torch's AdamW (fused), gradient
clipping at 1.0, one thread per rank, gloo. Each round runs one job of DDP and Slipstream's stages alternating in the
same processes (DDP, stage 0, ..., fresh engines each time, for every size), then one job of DeepSpeed's stages in
its own interpreter (``--deepspeed-python``: its venv; skipped without one); medians of each framework's steps over
the rounds, and ratios to DDP's and to DeepSpeed's same stage. ``--profile`` adds Python calls per step (cProfile,
rank 0, after warm-up) for every run: host work that grows with the tensor count shows as calls that grow with it.
A stage written ``S+cpu`` offloads the optimizer to CPU memory (stage 3: the parameters too), with the AdamW of the
config (Slipstream's CPU Adam op, DeepSpeed's ``DeepSpeedCPUAdam``) instead of torch's fused one; DDP's step stays
the fused AdamW, so its ratio includes the CPU Adam's own cost (on a CPU both step the same memory).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.common import free_port, setup_rank_env, time_steps  # noqa: E402

WARMUP, WIDTH, ROWS = 3, 8, 4


class Chain(torch.nn.Module):
    """``tensors // 2`` tiny linear layers in a row: as many parameter tensors as asked, no arithmetic to speak of."""

    def __init__(self, tensors: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(max(1, tensors // 2)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def _ddp(tensors: int) -> tuple[object, object]:
    model = Chain(tensors)
    if dist.get_world_size() > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True)

    def step(batch: torch.Tensor) -> None:
        model(batch).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()

    return step, None


def _engine(framework: str, tensors: int, stage: str) -> tuple[object, object]:
    """Slipstream's or DeepSpeed's engine at ``stage`` ("2", "3+cpu"), with torch's fused AdamW (the config's AdamW
    where the optimizer is offloaded) and clipping at 1.0, and its step."""
    model = Chain(tensors)
    level, _, offload = stage.partition("+")
    zero: dict = {"stage": int(level)}
    config: dict = {"train_micro_batch_size_per_gpu": ROWS, "gradient_clipping": 1.0, "zero_optimization": zero}
    if offload:
        zero["offload_optimizer"] = {"device": offload}
        if level == "3":
            zero["offload_param"] = {"device": offload}
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}

    def adamw(params: object) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True)  # type: ignore[arg-type]

    if framework == "zero":
        import slipstream

        engine = slipstream.initialize(model, {**config, "steps_per_print": 0}, optimizer=None if offload else adamw)
    else:
        import deepspeed

        config = {**config, "steps_per_print": 10**9, "zero_allow_untested_optimizer": True}
        optimizer = None if offload else adamw(model.parameters())
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), optimizer=optimizer, config=config
        )

    def step(batch: torch.Tensor) -> None:
        loss = engine(batch)
        engine.backward(loss)
        engine.step()

    return step, engine


def _calls(step: object, batches: list[torch.Tensor]) -> float:
    profile = cProfile.Profile()
    profile.enable()
    for batch in batches:
        step(batch)  # type: ignore[operator]
    profile.disable()
    return sum(entry[1] for entry in pstats.Stats(profile).stats.values()) / len(batches)  # type: ignore[attr-defined]


def worker(rank: int, world: int, port: int, kinds: list[str], args: argparse.Namespace) -> None:
    """One job: every size, the ``kinds`` ("ddp", "zero<s>", "deepspeed<s>") alternating; rank 0 writes the JSON."""
    setup_rank_env(rank, world, port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    generator = torch.Generator().manual_seed(rank)
    batches = [torch.randn(ROWS, WIDTH, generator=generator) for _ in range(WARMUP + args.steps)]
    found: dict[str, list[float]] = {}
    for tensors in args.tensors:
        for kind in kinds:
            framework = "zero" if kind.startswith("zero") else "deepspeed"
            step, engine = _ddp(tensors) if kind == "ddp" else _engine(framework, tensors, kind[len(framework) :])
            found[f"{tensors}/{kind}"] = time_steps(step, batches, WARMUP)  # type: ignore[arg-type]
            if args.profile:
                found[f"{tensors}/{kind}/calls"] = [_calls(step, batches[:3])]
            if engine is not None and hasattr(engine, "close"):
                engine.close()
    if rank == 0:
        Path(args.out).write_text(json.dumps(found))
    dist.destroy_process_group()


def _job(python: str, world: int, kinds: list[str], args: argparse.Namespace) -> dict[str, list[float]]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [
            python,
            __file__,
            "--worker",
            ",".join(kinds),
            "--world",
            str(world),
            "--out",
            out.name,
            "--steps",
            str(args.steps),
            "--tensors",
            *map(str, args.tensors),
            *(["--profile"] if args.profile else []),
        ]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu"}
        subprocess.run(command, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return json.loads(Path(out.name).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", type=int, nargs="+", default=[10, 100, 1000, 10000])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    parser.add_argument(
        "--stages", nargs="+", default=["0", "1", "2", "3"], help='"S", or "S+cpu": optimizer offloaded'
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--profile", action="store_true")
    default_ds = "/tmp/dsvenv/bin/python" if Path("/tmp/dsvenv/bin/python").exists() else None
    parser.add_argument(
        "--deepspeed-python", default=default_ds, help="DeepSpeed's venv interpreter (none: DeepSpeed is skipped)"
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        mp.spawn(worker, args=(args.world, free_port(), args.worker.split(","), args), nprocs=args.world)
        return
    ours = ["ddp", *(f"zero{s}" for s in args.stages)]
    theirs = [f"deepspeed{s}" for s in args.stages] if args.deepspeed_python else []
    print(
        f"Chain of Linear({WIDTH}, {WIDTH}), batch {ROWS} × {WIDTH}, AdamW(fused), clip 1.0, gloo, 1 thread per rank; "
        f"{args.rounds} rounds × {args.steps} steps (after {WARMUP} warm-up), DDP and Slipstream alternating in one job, "
        f"DeepSpeed's job after it{'' if theirs else ' (not run: no --deepspeed-python)'}"
    )
    head = "| ranks | tensors | DDP ms | " + " | ".join(
        f"ZeRO-{s} ms (×DDP{', ×DeepSpeed' if theirs else ''})" for s in args.stages
    )
    print(
        head
        + (" | " + " | ".join(f"DeepSpeed-{s} ms" for s in args.stages) if theirs else "")
        + (" | calls/step DDP, Z0.. | " if args.profile else " |")
    )
    for world in args.worlds:
        results: dict[str, list[float]] = {}
        for _ in range(args.rounds):
            for python, kinds in ((sys.executable, ours), (args.deepspeed_python, theirs)):
                if kinds:
                    for key, values in _job(python, world, kinds, args).items():
                        results.setdefault(key, []).extend(values)
        median = {key: statistics.median(values) for key, values in results.items()}
        for n in args.tensors:
            ddp = median[f"{n}/ddp"]
            cells = []
            for s in args.stages:
                ours_ms, peer = median[f"{n}/zero{s}"], median.get(f"{n}/deepspeed{s}")
                cells.append(
                    f"{ours_ms * 1e3:.2f} ({ours_ms / ddp:.2f}×" + (f", {ours_ms / peer:.2f}×)" if peer else ")")
                )
            cells += [f"{median[f'{n}/deepspeed{s}'] * 1e3:.2f}" for s in args.stages if theirs]
            calls = " | " + ", ".join(f"{median[f'{n}/{k}/calls']:.0f}" for k in ours + theirs) if args.profile else ""
            print(f"| {world} | {n} | {ddp * 1e3:.2f} | " + " | ".join(cells) + calls + " |")


if __name__ == "__main__":
    main()
