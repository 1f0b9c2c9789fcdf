"""Activation checkpointing and monitoring, side by side with DeepSpeed: step time and activation bytes.

    python benchmarks/bench_fit.py [--model gpt2-small] [--steps 20] [--rounds 3] [--deepspeed-python /tmp/dsvenv/bin/python]

One process, one thread, the BENCHMARKS.md workload (micro-batch 4 × 128 tokens, fp32, AdamW
fused, clip 1.0). Kinds, each a fresh process, alternating round by round:

* ``*-plain``: no checkpointing, no monitors;
* ``*-ac``: every GPT2Block checkpointed (slipstream: ``activation_checkpointing.module_classes``;
  DeepSpeed: ``deepspeed.checkpointing.checkpoint`` as the model's gradient-checkpointing function,
  the way the HF Trainer integrates it);
* ``*-monitored``: ``csv_monitor`` + ``wall_clock_breakdown`` + ``steps_per_print`` 5 (TensorBoard is
  left out: the DeepSpeed venv does not have it).

Activation bytes come from slipstream's LiveTensorMeter on one extra forward+backward of the bare
model (retained after forward; peak over forward and backward, gradients included alike).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
WARMUP = 5


def _meter_class() -> type:
    """LiveTensorMeter loaded from its file, so the DeepSpeed venv does not import slipstream's package."""
    spec = importlib.util.spec_from_file_location(
        "_live_meter", ROOT / "slipstream" / "engine" / "monitor" / "memory.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.LiveTensorMeter


def _worker(kind: str, args: argparse.Namespace) -> dict:
    import torch

    from benchmarks.common import build_gpt2, random_batches

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    torch.set_num_threads(1)
    framework, variant = kind.split("-")
    model = build_gpt2(args.model)
    model.config.use_cache = False  # training keeps no key/value cache (transformers keeps one by default)
    batches = random_batches(WARMUP + args.steps + 1)
    config: dict = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0}
    if variant == "monitored":
        out = tempfile.mkdtemp(prefix=f"bench-fit-{framework}-")
        config.update(
            steps_per_print=5,
            wall_clock_breakdown=True,
            csv_monitor={"enabled": True, "output_path": out, "job_name": "bench"},
        )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
    if framework == "slipstream":
        import slipstream

        if variant == "ac":
            config["activation_checkpointing"] = {"module_classes": ["GPT2Block"]}
        engine = slipstream.initialize(model, config, optimizer=optimizer)
    else:
        import deepspeed

        if variant == "ac":
            model._set_gradient_checkpointing(
                enable=True, gradient_checkpointing_func=deepspeed.checkpointing.checkpoint
            )
        config.update(zero_allow_untested_optimizer=True)
        config.setdefault("steps_per_print", 10**9)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    import time

    times = []
    for i, batch in enumerate(batches[:-1]):
        start = time.perf_counter()
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
        if i >= WARMUP:
            times.append(time.perf_counter() - start)
    meter_class = _meter_class()
    batch = batches[-1]
    model.train()
    with meter_class() as meter:
        loss = model(input_ids=batch, labels=batch).loss
        retained = meter.live()["cpu"]
        loss.backward()
    return {"times": times, "retained": retained, "peak": meter.peak["cpu"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2-small")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--deepspeed-python", default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=29561, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        Path(args.out).write_text(json.dumps(_worker(args.worker, args)))
        return

    deepspeed_python = args.deepspeed_python or (sys.executable if importlib.util.find_spec("deepspeed") else None)
    variants = ("plain", "ac", "monitored")
    kinds = [f"slipstream-{v}" for v in variants] + ([f"deepspeed-{v}" for v in variants] if deepspeed_python else [])
    results: dict[str, dict] = {k: {"times": []} for k in kinds}
    from benchmarks.common import free_port

    for _ in range(args.rounds):
        for kind in kinds:
            python = deepspeed_python if kind.startswith("deepspeed") else sys.executable
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
                    "--port",
                    str(free_port()),
                ]
                env = {**os.environ, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
                subprocess.run(
                    command, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
                data = json.loads(Path(out.name).read_text())
            results[kind]["times"] += data["times"]
            results[kind]["retained"], results[kind]["peak"] = data["retained"], data["peak"]

    print(
        f"{args.model}, 1 process (1 thread), fp32, AdamW(fused=True), clip 1.0, micro-batch 4 x 128 tokens; "
        f"{args.rounds} alternating rounds x {args.steps} steps"
    )
    print(
        f"{'config':<22} {'median ms':>9} {'min-max ms':>15} {'vs own plain':>12} {'vs DeepSpeed':>12} {'retained MiB':>12} {'peak MiB':>9}"
    )
    for kind in kinds:
        times = sorted(t * 1e3 for t in results[kind]["times"])
        median = statistics.median(times)
        own = statistics.median(results[kind.split("-")[0] + "-plain"]["times"]) * 1e3
        peer = kind.replace("slipstream", "deepspeed")
        vs_ds = (
            f"{median / (statistics.median(results[peer]['times']) * 1e3):.3f}x"
            if kind.startswith("slipstream") and peer in results
            else ""
        )
        r = results[kind]
        print(
            f"{kind:<22} {median:9.1f} {times[0]:7.1f}-{times[-1]:<7.1f} {median / own:11.3f}x {vs_ds:>12} {r['retained'] / 2**20:12.1f} {r['peak'] / 2**20:9.1f}"
        )


if __name__ == "__main__":
    main()
