"""Teardown stress: start and stop a 2-rank job many times and count the processes that abort at exit.

    .venv/bin/python benchmarks/bench_teardown.py [--cycles 50] [--nproc 2]

Each cycle launches ``slipstream run --nproc_per_node N`` on a small job (ZeRO-2 over the ring
collectives, async gradient reduce-scatters, a background checkpoint save, the user's own
``dist.all_reduce``) that returns from its script with collectives and threads still alive; the
variants alternate between a script that calls ``destroy_process_group()`` and one that does not
(what most scripts do). An abort is any cycle whose exit status is non-zero or whose output holds
"terminate called" / "SIGABRT" / "core dumped". Prints the count and the first abort's output.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

JOB = r"""
import sys
import torch, torch.distributed as dist
import slipstream

destroy = sys.argv[1] == "destroy"
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
engine = slipstream.initialize(model, {
    "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 2048}, "steps_per_print": 1000,
    "checkpoint": {"async_save": True},
})
for step in range(3):
    x = torch.randn(4, 64)
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()
engine.save_checkpoint(sys.argv[2], tag="t")
t = torch.ones(1024)
work = dist.all_reduce(t, async_op=True)   # the user's own collective, left in flight
if destroy:
    work.wait()
    engine.close()
    dist.destroy_process_group()
"""

ABORT_SIGNS = ("terminate called", "sigabrt", "core dumped", "aborted")


def run_cycle(script: Path, nproc: int, variant: str, save_dir: str) -> tuple[int, str, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SLIPSTREAM_ACCELERATOR": "cpu"}
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "slipstream.cli", "run", "--nproc_per_node", str(nproc), str(script), variant, save_dir],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=50)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    script = Path(tempfile.mkdtemp(prefix="slipstream-teardown-")) / "job.py"
    script.write_text(JOB)
    aborts: list[tuple[int, str, int, str]] = []
    seconds = []
    for cycle in range(args.cycles):
        variant = "destroy" if cycle % 2 == 0 else "keep"
        code, output, elapsed = run_cycle(script, args.nproc, variant, str(script.parent / f"ckpt{cycle}"))
        seconds.append(elapsed)
        if code != 0 or any(sign in output.lower() for sign in ABORT_SIGNS):
            aborts.append((cycle, variant, code, output))
        print(
            f"cycle {cycle + 1:3d}/{args.cycles} {variant:7s} exit {code} {elapsed:5.1f}s aborts so far {len(aborts)}",
            flush=True,
        )
    seconds.sort()
    print(
        f"\n{args.cycles} cycles of a {args.nproc}-rank job: {len(aborts)} aborted; median cycle {seconds[len(seconds) // 2]:.1f}s"
    )
    if aborts:
        cycle, variant, code, output = aborts[0]
        print(f"first abort: cycle {cycle + 1} ({variant}), exit {code}:\n{output[-3000:]}")
        sys.exit(1)


if __name__ == "__main__":
    main()
