"""Step time and memory of optimizer/parameter offload vs none, beside DeepSpeed's offload.

    python benchmarks/bench_offload.py [--model gpt2-large] [--steps 20] [--rounds 2] [--nvme-path /tmp]
                                       [--configs 2,2+cpu,3,3+cpu,3+nvme,3+nvme+nvme] [--deepspeed-python PY]

Configs: ``S`` ZeRO stage S without offload; ``S+cpu`` optimizer in CPU memory (stage 3: parameters
too); ``3+nvme`` optimizer state on NVMe; ``3+nvme+nvme`` optimizer state and parameters on NVMe.
Every run is a fresh 2-rank job (gloo, one thread per rank) with the same JSON config for
slipstream and DeepSpeed (AdamW lr 1e-3, weight decay 0.01, clipping 1.0, micro-batch 4, fp32; each
framework's defaults for the rest); configurations alternate round by round. Prints median step
time, the ratio to the same stage without offload, and the ratio to DeepSpeed.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
WARMUP = 5


def config_for(name: str, nvme_path: str) -> dict:
    stage, *offload = name.split("+")
    zero: dict = {"stage": int(stage)}
    if offload:
        device = offload[0]
        zero["offload_optimizer"] = {"device": device, **({"nvme_path": nvme_path} if device == "nvme" else {})}
        if int(stage) == 3 and (device == "cpu" or len(offload) > 1):
            param = offload[-1]
            zero["offload_param"] = {"device": param, **({"nvme_path": nvme_path} if param == "nvme" else {})}
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": zero,
    }


def _worker(rank: int, world: int, port: int, kind: str, args: argparse.Namespace, out: str) -> None:
    import torch
    import torch.distributed as dist

    from benchmarks.common import build_gpt2, random_batches, setup_rank_env, time_steps, write_rank_results

    setup_rank_env(rank, world, port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = build_gpt2(args.model)
    batches = random_batches(WARMUP + args.steps, seed=rank)
    framework, name = kind.split(":")
    config = config_for(name, args.nvme_path)
    if framework == "slipstream":
        import slipstream

        engine = slipstream.initialize(model, config)
    else:
        import deepspeed

        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    def step(batch: torch.Tensor) -> None:
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()

    write_rank_results(out, time_steps(step, batches, WARMUP))
    if framework == "slipstream":
        engine.close()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2-large")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--configs", default="2,2+cpu,3,3+cpu,3+nvme,3+nvme+nvme")
    parser.add_argument("--nvme-path", default="/tmp")
    parser.add_argument("--deepspeed-python", default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        import torch.multiprocessing as mp

        from benchmarks.common import free_port

        mp.spawn(_worker, args=(2, free_port(), args.worker, args, args.out), nprocs=2)
        return
    names = args.configs.split(",")
    kinds = [f"slipstream:{n}" for n in names] + ([f"deepspeed:{n}" for n in names] if args.deepspeed_python else [])
    results: dict[str, dict[str, list[float]]] = {k: {"times": [], "rss": []} for k in kinds}
    swap_root = tempfile.mkdtemp(prefix="bench-offload-", dir=args.nvme_path)
    try:
        for _ in range(args.rounds):
            for kind in kinds:
                python = args.deepspeed_python if kind.startswith("deepspeed") else sys.executable
                with tempfile.NamedTemporaryFile(suffix=".json") as out:
                    command = [
                        python,
                        __file__,
                        "--worker",
                        kind,
                        "--out",
                        out.name,
                        "--model",
                        args.model,
                        "--steps",
                        str(args.steps),
                        "--nvme-path",
                        swap_root,
                    ]
                    env = {"THP_MEM_ALLOC_ENABLE": "1", **os.environ, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu"}
                    done = subprocess.run(
                        command,
                        cwd=ROOT,
                        env=env,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.PIPE,
                        text=True,
                        check=False,
                    )
                    if done.returncode != 0:
                        print(
                            f"{kind} failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}"
                        )
                        continue
                    data = json.loads(Path(out.name).read_text())
                results[kind]["times"] += data["times"]
                results[kind]["rss"] = [max(a, b) for a, b in zip(results[kind]["rss"], data["rss"])] or data["rss"]
    finally:
        shutil.rmtree(swap_root, ignore_errors=True)

    def median_ms(kind: str) -> float | None:
        times = results.get(kind, {}).get("times")
        return statistics.median(times) * 1e3 if times else None

    print(
        f"{args.model}, 2 ranks (gloo, 1 thread each), fp32, AdamW, clip 1.0, micro-batch 4; swap files under "
        f"{args.nvme_path}; {args.rounds} alternating rounds x {args.steps} steps"
    )
    print(
        f"{'config':<26} {'median ms':>9} {'min-max ms':>15} {'peak RSS/rank MB':>17} {'vs no offload':>13} {'vs DeepSpeed':>12}"
    )
    for kind in kinds:
        median = median_ms(kind)
        if median is None:
            print(f"{kind:<26} {'failed':>9}")
            continue
        times = sorted(t * 1e3 for t in results[kind]["times"])
        base = median_ms(kind.split("+")[0])
        peer = median_ms(kind.replace("slipstream", "deepspeed")) if kind.startswith("slipstream") else None
        rss = "/".join(f"{r:.0f}" for r in results[kind]["rss"])
        vs_base = f"{median / base:.3f}x" if base else ""
        vs_ds = f"{median / peer:.3f}x" if peer else ""
        print(f"{kind:<26} {median:9.1f} {times[0]:7.1f}-{times[-1]:<7.1f} {rss:>17} {vs_base:>13} {vs_ds:>12}")


if __name__ == "__main__":
    main()
