"""What the numerical twin check costs: time to first loss at gpt2-large with ``twin_check`` on and off.

    python benchmarks/bench_twin_check.py [--rounds 3] [--modes ulysses,pp]

Model: gpt2-large of BENCHMARKS.md (8 layers, hidden 512, 8 heads, 29.5M parameters), fp32, AdamW,
micro-batch 4 × 128 tokens, 2 ranks on gloo, one thread each. Modes: ``ulysses``
(``sequence_parallel_size`` 2) and ``pp`` (2 stages, 1F1B, 4 micro-batches). Each job is a fresh pair
of processes; time to first loss is measured inside the job, from before ``initialize`` to the end
of the first optimizer step (the same on both sides: torch and transformers are imported before the
clock starts), and reported with ``initialize`` alone. Jobs alternate on/off round by round
(A B A B ...); the table gives medians over rounds and the ratio on/off.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.common import alternate_on_off, build_gpt2, random_batches, setup_rank_env  # noqa: E402

MODES = {"ulysses": ({"sequence_parallel_size": 2}, 1), "pp": ({"pipeline": {"stages": 2, "schedule": "1f1b"}}, 4)}


def _worker(rank: int, mode: str, twin: bool, port: int, out: str) -> None:
    import torch

    setup_rank_env(rank, 2, port)
    torch.set_num_threads(1)
    import slipstream

    extra, accumulation = MODES[mode]
    batches = random_batches(accumulation)
    start = time.perf_counter()
    engine = slipstream.initialize(
        build_gpt2("gpt2-large"),
        {
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": accumulation,
            "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
            "steps_per_print": 10**9,
            "twin_check": twin,
            **extra,
        },
    )
    ready = time.perf_counter()
    if mode == "pp":
        engine.train_batch(iter([{"input_ids": t, "labels": t} for t in batches]))
    else:
        loss = engine(input_ids=batches[0], labels=batches[0]).loss
        engine.backward(loss)
        engine.step()
    done = time.perf_counter()
    engine.destroy()
    if rank == 0:
        Path(f"{out}.{rank}").write_text(json.dumps({"initialize": ready - start, "first_loss": done - start}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", default="ulysses,pp")
    args = parser.parse_args()
    modes = args.modes.split(",")
    found = alternate_on_off(_worker, modes, args.rounds)
    print(f"gpt2-large, 2 ranks, medians of {args.rounds} alternating rounds (fresh jobs)")
    print(f"{'mode':<10}{'twin_check':<12}{'initialize s':>14}{'first loss s':>14}{'ratio on/off':>14}")
    for mode in modes:
        first = {twin: statistics.median(r["first_loss"] for r in found[(mode, twin)]) for twin in (True, False)}
        for twin in (True, False):
            init = statistics.median(r["initialize"] for r in found[(mode, twin)])
            ratio = f"{first[True] / first[False]:.3f}" if twin else ""
            print(f"{mode:<10}{str(twin).lower():<12}{init:>14.2f}{first[twin]:>14.2f}{ratio:>14}")


if __name__ == "__main__":
    main()
