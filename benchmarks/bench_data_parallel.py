"""Stage 0 vs torch DDP: step time of the same model, optimizer and data, side by side.

    python benchmarks/bench_data_parallel.py [--model gpt2-small] [--rounds 2] [--steps 20]

Both run on 2 ranks (gloo, one thread each) in the same processes, alternating A B A B, with
``torch.optim.AdamW(fused=True)`` (lr 1e-3, weight decay 0.01) and gradient clipping at 1.0.
Prints each run's median and the ratio of medians (target: stage 0 <= 1.05x DDP).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import (
    build_gpt2,
    current_rss_mb,
    free_port,
    lm_step,
    random_batches,
    setup_rank_env,
    summarize,
    time_steps,
)  # noqa: E402

WARMUP = 5


def run_ddp(model_name: str, batches: list[torch.Tensor]) -> list[float]:
    model = torch.nn.parallel.DistributedDataParallel(build_gpt2(model_name))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
    return time_steps(lm_step(model, optimizer), batches, WARMUP)


def run_slipstream(model_name: str, batches: list[torch.Tensor], config_extra: dict) -> list[float]:
    import slipstream

    config = {
        "train_micro_batch_size_per_gpu": batches[0].shape[0],
        "gradient_clipping": 1.0,
        "steps_per_print": 0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 0},
        **config_extra,
    }
    engine = slipstream.initialize(build_gpt2(model_name), config)

    def step(batch: torch.Tensor) -> None:
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()

    times = time_steps(step, batches, WARMUP)
    engine.close()
    return times


def worker(rank: int, world: int, port: int, args: argparse.Namespace, results: dict) -> None:
    setup_rank_env(rank, world, port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    batches = random_batches(WARMUP + args.steps, seed=rank)
    runs: dict[str, list[float]] = {"ddp": [], "slipstream": []}
    for _ in range(args.rounds):
        runs["ddp"] += run_ddp(args.model, batches)
        runs["slipstream"] += run_slipstream(args.model, batches, {})
    if rank == 0:
        results.update(runs)
        results["rss"] = current_rss_mb()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2-small")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(worker, args=(2, free_port(), args, results), nprocs=2)
        results = dict(results)
    print(
        f"{args.model}, 2 ranks, gloo, AdamW(fused=True), clip 1.0; {args.rounds} alternating rounds x {args.steps} steps"
    )
    print(summarize("torch DDP", results["ddp"]))
    print(summarize("slipstream stage 0", results["slipstream"]))
    ratio = statistics.median(results["slipstream"]) / statistics.median(results["ddp"])
    print(f"ratio slipstream / DDP (medians): {ratio:.3f}x  (target <= 1.05x)")


if __name__ == "__main__":
    main()
