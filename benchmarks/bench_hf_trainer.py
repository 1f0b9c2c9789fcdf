"""HF Trainer + Slipstream vs HF Trainer + DeepSpeed: the same script, the same ZeRO config, 2 ranks.

Run: ``python benchmarks/bench_hf_trainer.py --ds-python /work/ds-venv/bin/python [--model gpt2-large]``.
Each side runs in its own interpreter (DeepSpeed lives in its own venv), alternating A B A B;
reported are medians of the step time, peak RSS per rank and time to the first loss, with ratios
Slipstream / DeepSpeed (below 1 is better for Slipstream).

[Note: one worker file] ``--worker`` is this same file run under ``torch.distributed.run`` by each
side's interpreter; only the Trainer/arguments classes differ between the sides.
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = {
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"},
    "steps_per_print": 2000,
}


def worker(side: str, model_name: str, steps: int, out: str, config_path: str) -> None:
    started = time.perf_counter()
    sys.path.insert(0, ROOT)
    import torch
    import torch.distributed as dist
    from transformers import TrainerCallback

    from benchmarks.common import MICRO_BATCH, build_gpt2, random_batches, write_rank_results

    if side == "slipstream":
        from slipstream.integrations.transformers import SlipstreamTrainer as Trainer
        from slipstream.integrations.transformers import SlipstreamTrainingArguments as Arguments
    else:
        from transformers import Trainer
        from transformers import TrainingArguments as Arguments
    times: list[float] = []
    first_loss: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a: object, **k: object) -> None:
            self.t = time.perf_counter()

        def on_step_end(self, *a: object, **k: object) -> None:
            times.append(time.perf_counter() - self.t)
            if not first_loss:
                first_loss.append(time.perf_counter() - started)

    rows = [t for b in random_batches(steps * 2, MICRO_BATCH) for t in b]
    data = [{"input_ids": r, "labels": r} for r in rows]
    args = Arguments(
        output_dir=tempfile.mkdtemp(),
        deepspeed=config_path,
        per_device_train_batch_size=MICRO_BATCH,
        max_steps=steps,
        learning_rate=1e-4,
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
        save_strategy="no",
        logging_steps=10**6,
        disable_tqdm=True,
    )
    model = build_gpt2(model_name)
    model.loss_type = "ForCausalLM"  # GPT2LMHeadModel maps to no loss type by name; same loss, no warning
    Trainer(model=model, args=args, train_dataset=data, callbacks=[Clock()]).train()
    write_rank_results(out, times[1:])
    if dist.get_rank() == 0:
        result = json.load(open(out))
        result["first_loss_s"] = first_loss[0]
        json.dump(result, open(out, "w"))


def run_side(python: str, side: str, model: str, steps: int, config_path: str) -> dict:
    out = tempfile.mktemp(suffix=".json")
    sys.path.insert(0, ROOT)
    from benchmarks.common import free_port

    cmd = [
        python,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        __file__,
        "--worker",
        side,
        "--model",
        model,
        "--steps",
        str(steps),
        "--out",
        out,
        "--config",
        config_path,
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "DS_ACCELERATOR": "cpu",
        "PYTHONPATH": ROOT,
    }
    subprocess.run(cmd, check=True, cwd=ROOT, env=env)
    return json.load(open(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", choices=["slipstream", "deepspeed"])
    parser.add_argument("--model", default="gpt2-large")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out")
    parser.add_argument("--config")
    parser.add_argument("--ds-python", default="/work/ds-venv/bin/python")
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.model, args.steps, args.out, args.config)
    config_path = tempfile.mktemp(suffix=".json")
    json.dump(CONFIG, open(config_path, "w"))
    results: dict[str, list[dict]] = {"slipstream": [], "deepspeed": []}
    for _ in range(args.rounds):  # A B A B
        results["slipstream"].append(run_side(sys.executable, "slipstream", args.model, args.steps, config_path))
        results["deepspeed"].append(run_side(args.ds_python, "deepspeed", args.model, args.steps, config_path))
    summary = {}
    for side, runs in results.items():
        summary[side] = {
            "step_ms": statistics.median(t * 1e3 for r in runs for t in r["times"]),
            "peak_rss_mb": statistics.median(max(r["rss"]) for r in runs),
            "first_loss_s": statistics.median(r["first_loss_s"] for r in runs),
        }
        print(
            f"{side:<10} step {summary[side]['step_ms']:8.1f} ms  peak RSS/rank {summary[side]['peak_rss_mb']:8.0f} MB  "
            f"first loss {summary[side]['first_loss_s']:6.1f} s"
        )
    for key in ("step_ms", "peak_rss_mb", "first_loss_s"):
        print(f"ratio slipstream/deepspeed {key}: {summary['slipstream'][key] / summary['deepspeed'][key]:.3f}")


if __name__ == "__main__":
    main()
