"""Host overhead per step: a launch-bound model swept over its number of parameter tensors, Slipstream's ZeRO
stages against torch DDP (issue 50).

    python benchmarks/bench_overhead.py [--tensors 10 100 1000 10000] [--worlds 1 2] [--stages 0 1 2 3]
                                        [--rounds 2] [--steps 10] [--profile]

The model is a chain of ``Linear(8, 8)`` layers (two tensors each) on a 4 × 8 batch: its arithmetic is nothing,
so a step is what the host does around it — autograd's nodes (the same for everyone), per-parameter hooks,
bookkeeping, copies and optimizer launches. Every framework uses AdamW (fused where torch has it), gradient
clipping at 1.0, one thread per rank, gloo. In the same processes the frameworks alternate, round after round
(DDP, stage 0, DDP, stage 1, ...), fresh engines each time; medians of each framework's steps over the rounds and
the ratio to DDP's median of the same round set. ``--profile`` adds Python calls per step (cProfile, rank 0,
after warm-up) for every run: host work that grows with the tensor count shows as calls that grow with it.

DeepSpeed is not run here: it needs its own venv (``deepspeed==0.19.8``); see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
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


def _slipstream(tensors: int, stage: int) -> tuple[object, object]:
    import slipstream

    config = {
        "train_micro_batch_size_per_gpu": ROWS, "gradient_clipping": 1.0, "steps_per_print": 0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage},
    }  # fmt: skip
    engine = slipstream.initialize(Chain(tensors), config)

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


def worker(rank: int, world: int, port: int, args: argparse.Namespace, results: dict) -> None:
    setup_rank_env(rank, world, port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    generator = torch.Generator().manual_seed(rank)
    batches = [torch.randn(ROWS, WIDTH, generator=generator) for _ in range(WARMUP + args.steps)]
    found: dict[str, list[float]] = {}
    for tensors in args.tensors:
        for _ in range(args.rounds):
            for name in ["ddp", *(f"zero{s}" for s in args.stages)]:
                step, engine = _ddp(tensors) if name == "ddp" else _slipstream(tensors, int(name[4:]))
                found.setdefault(f"{tensors}/{name}", []).extend(time_steps(step, batches, WARMUP))  # type: ignore[arg-type]
                if args.profile:
                    found.setdefault(f"{tensors}/{name}/calls", []).append(_calls(step, batches[:3]))
                if engine is not None:
                    engine.close()
    if rank == 0:
        results.update(found)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", type=int, nargs="+", default=[10, 100, 1000, 10000])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    print(f"Chain of Linear({WIDTH}, {WIDTH}), batch {ROWS} × {WIDTH}, AdamW, clip 1.0, gloo, 1 thread per rank; "
          f"{args.rounds} alternating rounds × {args.steps} steps (after {WARMUP} warm-up)")  # fmt: skip
    print("| ranks | tensors | DDP ms | " + " | ".join(f"ZeRO-{s} ms (×DDP)" for s in args.stages) + (" | calls/step DDP, " + ", ".join(f"Z{s}" for s in args.stages) if args.profile else "") + " |")
    print("|---|---|---|" + "---|" * len(args.stages) + ("---|" if args.profile else ""))
    for world in args.worlds:
        with mp.Manager() as manager:
            results = manager.dict()
            mp.spawn(worker, args=(world, free_port(), args, results), nprocs=world)
            results = dict(results)
        for tensors in args.tensors:
            ddp = statistics.median(results[f"{tensors}/ddp"])
            cells = [f"{statistics.median(results[f'{tensors}/zero{s}']) * 1e3:.2f} ({statistics.median(results[f'{tensors}/zero{s}']) / ddp:.2f}×)" for s in args.stages]
            calls = ""
            if args.profile:
                calls = " | " + ", ".join(f"{statistics.median(results[f'{tensors}/{n}/calls']):.0f}" for n in ["ddp", *(f"zero{s}" for s in args.stages)])
            print(f"| {world} | {tensors} | {ddp * 1e3:.2f} | " + " | ".join(cells) + calls + " |")


if __name__ == "__main__":
    main()
