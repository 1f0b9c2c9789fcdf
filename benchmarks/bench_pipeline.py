"""Pipeline parallel 2 (1F1B and ZB-V) vs data parallel 2 (ZeRO-1) vs DeepSpeed's PipelineModule 1F1B.

    python benchmarks/bench_pipeline.py [--steps 4] [--rounds 3] [--micro-batches 8]
                                        [--deepspeed-python /work/ds-venv/bin/python]

Model: gpt2-large of BENCHMARKS.md (8 layers, n_embd 512, vocab 8192, seq 128), micro-batch 4,
fp32, AdamW lr 1e-3, clip 1.0, 2 ranks (gloo, one thread each). Every configuration trains the same
global batch per step (``--micro-batches`` × 4 sequences):

* ``pp2-1f1b`` / ``pp2-zbv``: slipstream, pipeline.stages 2, the unchanged ``GPT2LMHeadModel``
  (embedding tied to the head across the two ends), the user's loop, stages balanced by
  parameter count (DeepSpeed's default); ``-profile``: balanced by measured block times;
* ``dp2-zero1``: slipstream, dp 2, ZeRO-1, half the micro-batches on each rank;
* ``ds-pipe``: DeepSpeed 0.19.8 ``PipelineModule`` (the model rewritten as a list of layers with a
  ``TiedLayerSpec`` embedding/head, its only schedule, 1F1B) and ``train_batch``, ZeRO-1.

Printed: median step time, tokens/s, peak RSS per rank, and for slipstream's pipelines the bubble
each rank measured next to the schedule's prediction for the measured pass costs. Each
configuration is a fresh 2-rank job; configurations alternate round by round (A B C D A B C D).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
WARMUP = 2
# The cut slipstream's ZB-V picks with partition "parameters" on gpt2-large (logged "blocks per stage"):
# torch's ZBV gets the same stages so the comparison is schedule against schedule.
ZBV_CUT = [2, 2, 3, 1]


def _config(kind: str, m: int) -> dict:
    base = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
    }
    if kind == "dp2-zero1":
        return {**base, "gradient_accumulation_steps": m // 2, "zero_optimization": {"stage": 1}}
    if kind == "ds-pipe":
        return {
            **base,
            "gradient_accumulation_steps": m,
            "zero_optimization": {"stage": 1},
            "pipeline": {"activation_checkpoint_interval": 0},
        }
    schedule, _, partition = kind.split("-", 1)[1].partition("-")
    pipeline = {
        "stages": 2,
        "schedule": schedule,
        "virtual_stages": 2 if schedule == "zbv" else 1,
        "partition": partition or "parameters",
    }
    # wall_clock_breakdown: the executor times the step from one barrier and takes the slowest rank's
    # wall time, so the measured bubble compares with the simulator's (executor.py, [Note: timing a step]).
    return {**base, "gradient_accumulation_steps": m, "pipeline": pipeline, "wall_clock_breakdown": True}


def _next_token_loss(logits, labels):
    """GPT2LMHeadModel's loss, for the peers that compute it outside the model (DeepSpeed's PipelineModule, torch's ZBV)."""
    import torch

    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def _deepspeed_pipe(model, m: int):
    """GPT-2 as DeepSpeed's PipelineModule wants it: embedding, blocks, final norm, tied head, loss."""
    import deepspeed
    import torch
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    class Embed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.wpe = model.transformer.wte, model.transformer.wpe

        def forward(self, ids):
            return self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))

    class Block(torch.nn.Module):
        def __init__(self, index: int) -> None:
            super().__init__()
            self.block = model.transformer.h[index]

        def forward(self, hidden):
            return self.block(hidden)

    class Norm(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln = model.transformer.ln_f

        def forward(self, hidden):
            return self.ln(hidden)

    def head(embed, hidden):
        return hidden @ embed.wte.weight.t()

    layers = [
        TiedLayerSpec("embed", Embed, tied_weight_attr="wte.weight"),
        *[LayerSpec(Block, i) for i in range(len(model.transformer.h))],
        LayerSpec(Norm),
        TiedLayerSpec("embed", Embed, forward_fn=head, tied_weight_attr="wte.weight"),
    ]
    return PipelineModule(
        layers=layers, num_stages=2, loss_fn=_next_token_loss, partition_method="parameters"
    ), deepspeed


def _torch_zbv(model, rank: int, m: int, blocks_per_stage: list[int]):
    """``torch.distributed.pipelining``'s ZBV on the same GPT-2, batch and cut: stages of ``blocks_per_stage``
    blocks, rank r holding stages r and 3 - r; the head reuses the embedding's weight (both ends on rank 0)."""
    import torch
    from torch.distributed.pipelining import PipelineStage, ScheduleZBVZeroBubble

    starts = [sum(blocks_per_stage[:i]) for i in range(len(blocks_per_stage) + 1)]
    t = model.transformer

    class Stage(torch.nn.Module):
        def __init__(self, index: int) -> None:
            super().__init__()
            self.first, self.last = index == 0, index == len(blocks_per_stage) - 1
            self.blocks = torch.nn.ModuleList(t.h[starts[index] : starts[index + 1]])
            if self.first:
                self.wte, self.wpe = t.wte, t.wpe
            if self.last:
                self.ln_f, self.head = t.ln_f, t.wte  # the tied weight: the same Parameter on rank 0

        def forward(self, x):
            hidden = self.wte(x) + self.wpe(torch.arange(x.shape[1])) if self.first else x
            for block in self.blocks:
                hidden = block(hidden)
            return self.ln_f(hidden) @ self.head.weight.t() if self.last else hidden

    n = len(blocks_per_stage)
    modules = [Stage(rank), Stage(n - 1 - rank)]
    stages = [PipelineStage(mod, i, n, torch.device("cpu")) for mod, i in zip(modules, (rank, n - 1 - rank))]
    schedule = ScheduleZBVZeroBubble(stages, n_microbatches=m, loss_fn=_next_token_loss)
    params = list({id(p): p for mod in modules for p in mod.parameters()}.values())
    return schedule, params


def _worker(rank: int, kind: str, steps: int, m: int, port: int, out: str) -> None:
    from benchmarks.common import current_rss_mb, peak_rss_mb, setup_rank_env

    setup_rank_env(rank, 2, port)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from benchmarks.common import build_gpt2, random_batches

    model = build_gpt2("gpt2-large")
    batches = random_batches((WARMUP + steps) * m, seed=1)
    bubbles: list[tuple[float, float]] = []
    if kind == "ds-pipe":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        pipe, deepspeed = _deepspeed_pipe(model, m)
        engine, *_ = deepspeed.initialize(
            model=pipe, model_parameters=[p for p in pipe.parameters() if p.requires_grad], config=_config(kind, m)
        )

        def step(k: int) -> None:
            engine.train_batch(iter([(b, b) for b in batches[k * m : (k + 1) * m]]))
    elif kind == "torch-zbv":
        dist.init_process_group("gloo")
        schedule, params = _torch_zbv(model, rank, m, ZBV_CUT)
        optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)

        def step(k: int) -> None:
            batch = torch.cat(batches[k * m : (k + 1) * m])
            if rank == 0:  # both ends of the V: the input and the loss
                schedule.step(batch, target=batch)
            else:
                schedule.step()
            squares = torch.stack([p.grad.pow(2).sum() for p in params if p.grad is not None]).sum()
            dist.all_reduce(squares)  # clipping at 1.0 over the whole model, as the engines do
            torch.nn.utils.clip_grads_with_norm_(params, 1.0, squares.sqrt())
            optimizer.step()
            optimizer.zero_grad()
    else:
        import slipstream

        engine = slipstream.initialize(model, _config(kind, m))
        per_rank = m if kind.startswith("pp") else m // 2

        def step(k: int) -> None:
            window = batches[k * m : (k + 1) * m]
            mine = window if kind.startswith("pp") else window[rank::2]
            for b in mine[:per_rank]:
                loss = engine(input_ids=b, labels=b).loss
                engine.backward(loss)
                engine.step()
            if engine.pipeline is not None:
                report = engine.pipeline.last_report
                bubbles.append((report.timing.bubble, report.predicted_bubble))

    times, faults = [], []
    for k in range(WARMUP + steps):
        dist.barrier()
        start, faulted = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        step(k)
        dist.barrier()
        if k >= WARMUP:
            times.append(time.perf_counter() - start)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faulted)
    record = {
        "times": times,
        "faults": faults,
        "peak": peak_rss_mb(),
        "end": current_rss_mb(),
        "bubbles": bubbles[WARMUP:],
    }
    Path(f"{out}.{rank}").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


def _run(python: str, kind: str, steps: int, m: int) -> list[dict] | str:
    import os

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "r")
        command = [python, __file__, "--worker", kind, "--steps", str(steps), "--micro-batches", str(m), "--out", out]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu", "MALLOC_ARENA_MAX": "2"}
        done = subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        found = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2) if Path(f"{out}.{r}").exists()]
        if done.returncode != 0 or len(found) < 2:
            lines = [
                x for x in done.stderr.strip().splitlines() if "Error" in x or "error" in x
            ] or done.stderr.strip().splitlines()[-1:]
            return lines[-1] if lines else f"exit {done.returncode}"
        return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--deepspeed-python", default=None)
    parser.add_argument("--kinds", default=None, help="comma-separated subset of the configurations")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        import torch.multiprocessing as mp

        from benchmarks.common import free_port

        mp.start_processes(
            _worker,
            args=(args.worker, args.steps, args.micro_batches, free_port(), args.out),
            nprocs=2,
            start_method="spawn",
        )
        return
    kinds = ["pp2-1f1b", "pp2-1f1b-profile", "pp2-zbv", "pp2-zbv-profile", "torch-zbv", "dp2-zero1"] + (
        ["ds-pipe"] if args.deepspeed_python else []
    )
    if args.kinds:
        kinds = [k for k in kinds if k in args.kinds.split(",")]
    python = {k: args.deepspeed_python if k.startswith("ds") else sys.executable for k in kinds}
    results: dict[str, dict] = {
        k: {"times": [], "peak": [0.0, 0.0], "bubbles": [[], []], "faults": [[], []], "rounds": [], "error": None}
        for k in kinds
    }
    for _ in range(args.rounds):
        for kind in kinds:
            data = _run(python[kind], kind, args.steps, args.micro_batches)
            if isinstance(data, str):
                results[kind]["error"] = data
                continue
            results[kind]["times"] += data[0]["times"]
            results[kind]["rounds"].append(statistics.median(data[0]["times"]))
            results[kind]["peak"] = [max(a, d["peak"]) for a, d in zip(results[kind]["peak"], data)]
            for r in range(2):
                results[kind]["bubbles"][r] += data[r]["bubbles"]
                results[kind]["faults"][r] += data[r]["faults"]
    m = args.micro_batches
    tokens = m * 4 * 128
    print(
        f"gpt2-large (8 layers, n_embd 512, vocab 8192), seq 128, {m} micro-batches of 4 per step ({tokens} tokens), fp32, "
        f"2 ranks; {args.rounds} alternating rounds x {args.steps} steps"
    )
    print(
        f"{'config':<17} {'median ms':>9} {'tokens/s':>9} {'peak RSS/rank MB':>17} {'bubble measured/predicted r0, r1':>34} {'vs dp2-zero1':>13} {'page faults/step r0/r1':>23}"
    )
    base = (
        statistics.median(results["dp2-zero1"]["times"])
        if "dp2-zero1" in results and results["dp2-zero1"]["times"]
        else None
    )
    for kind in kinds:
        r = results[kind]
        if not r["times"]:
            print(f"{kind:<17} failed: {r['error']}")
            continue
        median = statistics.median(r["times"])
        bubble = (
            ", ".join(
                f"{statistics.median(b[0] for b in bs):.3f}/{statistics.median(b[1] for b in bs):.3f}"
                for bs in r["bubbles"]
                if bs
            )
            or "-"
        )
        vs = f"{median / base:.3f}x" if base else ""
        faults = "/".join(f"{statistics.median(f):.0f}" for f in r["faults"] if f)
        print(
            f"{kind:<17} {median * 1e3:9.1f} {tokens / median:9.0f} {'/'.join(f'{x:.0f}' for x in r['peak']):>17} {bubble:>34} {vs:>13} {faults:>23}"
        )
    if all(k in results and results[k]["times"] for k in ("pp2-zbv", "torch-zbv", "pp2-1f1b")):
        zbv = statistics.median(results["pp2-zbv"]["times"])
        print(
            f"pp2-zbv vs torch.distributed.pipelining ZBV (same cut {ZBV_CUT}): {zbv / statistics.median(results['torch-zbv']['times']):.3f}x; "
            f"vs our 1F1B: {zbv / statistics.median(results['pp2-1f1b']['times']):.3f}x"
        )
        # Neighbouring jobs drift less than the machine does between rounds: each round's ratio too.
        for peer in ("torch-zbv", "pp2-1f1b"):
            paired = [a / b for a, b in zip(results["pp2-zbv"]["rounds"], results[peer]["rounds"])]
            print(
                f"  per round, pp2-zbv / {peer}: {' '.join(f'{r:.3f}' for r in paired)}  median {statistics.median(paired):.3f}x"
            )
    if "ds-pipe" in results and results["ds-pipe"]["times"] and "pp2-1f1b" in results and results["pp2-1f1b"]["times"]:
        ratio = statistics.median(results["pp2-1f1b"]["times"]) / statistics.median(results["ds-pipe"]["times"])
        print(f"pp2-1f1b vs DeepSpeed PipelineModule 1F1B (same tokens per step): {ratio:.3f}x")


if __name__ == "__main__":
    main()
