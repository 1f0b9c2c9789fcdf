"""Start-up cost: ``import slipstream`` vs ``import torch``, and launch-to-first-loss vs plain DDP.

    python benchmarks/bench_startup.py [--repeats 3] [--config examples/configs/zero2_offload_cpu.json ...]

Time to first loss is the wall time from starting the launcher to rank 0 printing the loss of its
first optimizer step: `slipstream run ... examples/train_gpt2.py` against
`torchrun ... benchmarks/ddp_gpt2.py` (same model, data and optimizer), run alternately.
Each ``--config`` is timed on its own against the same DDP runs (default: the example's own
config). Targets: `import slipstream` overhead <= 0.3 s; first-loss ratio <= 1.3x for every config.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def wall(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True)
    return time.perf_counter() - start


def time_to_first_loss(cmd: list[str]) -> float:
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("step    1 |"):
            elapsed = time.perf_counter() - start
            proc.wait()
            return elapsed
    proc.wait()
    raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode} before printing a loss")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--config", action="append", default=[], help="a slipstream config to time (repeatable)")
    args = parser.parse_args()
    py = sys.executable
    programs = {
        "import torch": "import torch",
        "import torch, slipstream": "import torch, slipstream",
        # resolving initialize pulls in the engine, config (pydantic) and comm layers
        "... + slipstream.initialize": "import torch, slipstream; slipstream.initialize",
    }
    imports: dict[str, list[float]] = {name: [] for name in programs}
    for _ in range(5):
        for name, program in programs.items():
            imports[name].append(wall([py, "-c", program]))
    base = statistics.median(imports["import torch"])
    for name, times in imports.items():
        print(
            f"{name:<30} {statistics.median(times):.2f} s (median of 5)  overhead vs torch {statistics.median(times) - base:+.2f} s"
        )

    ours = [
        str(BIN / "slipstream"),
        "run",
        "--nproc_per_node",
        "2",
        "examples/train_gpt2.py",
        "--steps",
        "1",
        "--print-every",
        "1",
    ]
    ddp = [
        str(BIN / "torchrun"),
        "--nproc_per_node",
        "2",
        "benchmarks/ddp_gpt2.py",
        "--steps",
        "1",
        "--print-every",
        "1",
    ]
    configs = args.config or [None]
    first: dict[str, list[float]] = {"ddp": [], **{str(c or "default"): [] for c in configs}}
    for _ in range(args.repeats):  # alternating: DDP, then each config
        first["ddp"].append(time_to_first_loss(ddp))
        for config in configs:
            first[str(config or "default")].append(time_to_first_loss(ours + (["--config", config] if config else [])))
    b = statistics.median(first["ddp"])
    print(f"time to first loss, 2 ranks gpt2-small (median of {args.repeats}); torchrun DDP {b:.2f} s")
    for name in first:
        if name != "ddp":
            a = statistics.median(first[name])
            print(f"  slipstream run ({name}): {a:.2f} s | ratio {a / b:.2f}x (target <= 1.3x)")
    print("  runs:", {k: [round(v, 2) for v in vs] for k, vs in first.items()})


if __name__ == "__main__":
    main()
