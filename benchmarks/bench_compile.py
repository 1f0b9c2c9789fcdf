"""``compile`` vs eager at ZeRO 0 and 3, beside DeepSpeed's ``engine.compile()``: step time and time to first loss.

    python benchmarks/bench_compile.py [--model gpt2-large] [--stages 0,3] [--steps 10] [--rounds 2]
                                       [--deepspeed-python /tmp/dsvenv/bin/python] [--warm-cache]

Every configuration is a fresh 2-rank job (gloo, one thread per rank) and the configurations
alternate round by round (A B A B ...): slipstream eager, slipstream with ``compile.enabled``
(CPU inductor, each block compiled), and, with ``--deepspeed-python``, DeepSpeed 0.19.8 eager and
after ``engine.compile()`` on the same JSON config. All use AdamW(fused=True) lr 1e-3, weight decay
0.01, gradient clipping 1.0 (set: DeepSpeed clips at 1.0 when unset), micro-batch 4, fp32.

Each job reports its steady step time (median after ``WARMUP`` steps, which include compiling) and
its time to first loss: from just before ``initialize`` to the first loss on the host, so compiling
is in it. Each job gets an empty inductor cache (cold compile) unless ``--warm-cache``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
WARMUP = 3


def _config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": stage},
    }


def _worker(rank: int, world: int, port: int, kind: str, args: argparse.Namespace, out: str) -> None:
    import torch
    import torch.distributed as dist

    from benchmarks.common import build_gpt2, random_batches, setup_rank_env, time_steps

    setup_rank_env(rank, world, port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    framework, stage, mode = kind.split("-")
    model = build_gpt2(args.model)
    batches = random_batches(WARMUP + args.steps, seed=rank)
    config = _config(int(stage))

    def adamw(params: object) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True)

    dist.barrier()
    start = time.perf_counter()
    error = None
    if framework == "slipstream":
        import slipstream

        engine = slipstream.initialize(model, {**config, "compile": {"enabled": mode == "compiled"}}, optimizer=adamw)
    else:
        import deepspeed

        config = {**config, "zero_allow_untested_optimizer": True}
        engine, *_ = deepspeed.initialize(model=model, optimizer=adamw(model.parameters()), config=config)
        if mode == "compiled":
            engine.compile()

    def step(batch: torch.Tensor) -> None:
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()

    try:
        first = engine(input_ids=batches[0], labels=batches[0]).loss
        float(first.detach())
        first_loss_s = time.perf_counter() - start
        engine.backward(first)
        engine.step()
        times = time_steps(step, batches[1:], WARMUP - 1)
    except Exception as err:  # noqa: BLE001 - a peer's compile failing is a result to report
        error, first_loss_s, times = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}", float("nan"), []
    if rank == 0:
        Path(out).write_text(json.dumps({"times": times, "first_loss_s": first_loss_s, "error": error}))
    dist.barrier()
    dist.destroy_process_group()


def run_worker(kind: str, args: argparse.Namespace) -> None:
    import torch.multiprocessing as mp

    from benchmarks.common import free_port

    mp.spawn(_worker, args=(2, free_port(), kind, args, args.out), nprocs=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2-large")
    parser.add_argument("--stages", default="0,3")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--deepspeed-python", default=None)
    parser.add_argument("--job-timeout", type=float, default=900.0, help="seconds one job may take")
    parser.add_argument(
        "--warm-cache", action="store_true", help="share one inductor cache between jobs (default: a cold one per job)"
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker(args.worker, args)
        return

    frameworks = ["slipstream"] + (["deepspeed"] if args.deepspeed_python else [])
    kinds = [f"{f}-{s}-{m}" for f in frameworks for s in args.stages.split(",") for m in ("eager", "compiled")]
    results: dict[str, dict] = {k: {"times": [], "first": [], "rounds": [], "error": None} for k in kinds}
    shared_cache = tempfile.mkdtemp(prefix="inductor-") if args.warm_cache else None
    for _ in range(args.rounds):
        for kind in kinds:
            python = args.deepspeed_python if kind.startswith("deepspeed") else sys.executable
            with (
                tempfile.NamedTemporaryFile(suffix=".json") as out,
                tempfile.TemporaryDirectory(prefix="inductor-") as cache,
            ):
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
                ]
                env = {
                    **os.environ,
                    "PYTHONPATH": str(ROOT),
                    "DS_ACCELERATOR": "cpu",
                    "THP_MEM_ALLOC_ENABLE": "1",
                    "TORCHINDUCTOR_CACHE_DIR": shared_cache or cache,
                }
                try:
                    done = subprocess.run(
                        command,
                        cwd=ROOT,
                        env=env,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.PIPE,
                        text=True,
                        timeout=args.job_timeout,
                    )
                    why = (done.stderr.strip().splitlines() or ["no result"])[-1][:200]
                except subprocess.TimeoutExpired:
                    why = f"no first loss within {args.job_timeout} s"
                text = Path(out.name).read_text() if Path(out.name).stat().st_size else ""
            if not text:
                results[kind]["error"] = why
                continue
            data = json.loads(text)
            results[kind]["error"] = data["error"]
            if data["times"]:
                results[kind]["times"] += data["times"]
                results[kind]["rounds"].append(statistics.median(data["times"]))
                results[kind]["first"].append(data["first_loss_s"])

    print(
        f"{args.model}, 2 ranks (gloo, 1 thread each), fp32, AdamW(fused=True), clip 1.0, micro-batch 4; "
        f"{args.rounds} alternating rounds x {args.steps} steps; inductor cache {'shared' if args.warm_cache else 'cold per job'}"
    )
    print(f"{'config':<24} {'median ms':>9} {'first loss s':>13} {'compiled / eager':>17}")
    for kind in kinds:
        entry = results[kind]
        if not entry["times"]:
            print(f"{kind:<24} failed: {entry['error']}")
            continue
        median = statistics.median(entry["times"]) * 1e3
        first = statistics.median(entry["first"])
        ratio = ""
        eager = results.get(kind.replace("compiled", "eager"))
        if kind.endswith("compiled") and eager and eager["times"]:
            ratio = f"{median / (statistics.median(eager['times']) * 1e3):.3f}x"
        print(f"{kind:<24} {median:9.1f} {first:13.1f} {ratio:>17}")


if __name__ == "__main__":
    main()
