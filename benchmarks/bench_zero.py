"""ZeRO stages 0-3 vs torch DDP, FSDP2 and DeepSpeed (where installed): step time and peak RSS per rank.

    python benchmarks/bench_zero.py [--model gpt2-large] [--steps 20] [--rounds 2] [--stages 0,1,2,3,3+cpu,3+nvme] [--world 2]
                                    [--peers ddp,fsdp2] [--deepspeed-python /path/to/venv/bin/python] [--deepspeed-stages 3]

A stage written ``S+cpu`` / ``S+nvme`` / ``3+nvme+nvme`` offloads as ``bench_offload.py`` names it
(that script's JSON, optimizer from the config for both frameworks, NVMe under ``--nvme-path``).
``3+reuse`` is stage 3 with ``stage3_max_reuse_distance: 1e9`` (DeepSpeed's default, set explicitly:
every block stays gathered from its forward into its backward; DeepSpeed's 3 and 3+reuse are alike).
A stage ending in ``+sockets`` (``3+sockets``, ``3+reuse+sockets``) runs with the same-host shared-memory
collectives off (``SLIPSTREAM_SHM_COLLECTIVES=0``): gloo's loopback sockets, as before they existed.
Large CPU blocks are mapped on their own by default (``slipstream/ops/large_blocks.py``); a stage
ending in ``+glibc`` (``3+glibc``) keeps every block in glibc's malloc (``SLIPSTREAM_LARGE_BLOCKS=0``),
one ending in ``+4m`` maps blocks from 4 MiB (``SLIPSTREAM_LARGE_BLOCKS=4194304``, the default until 2026-12-03) rather than 1. A stage
ending in ``+trim`` returns glibc's free heap pages after every step (``malloc_trim(0)`` in the loop).

FSDP2 shards with ``fully_shard`` on every GPT2Block and then the root (the units ZeRO-3 picks).

Memory: peak RSS per rank (``ru_maxrss``, the whole run) and, over a few untimed steps after the timed
ones, a sampler's peak PSS (a shared page split between the ranks that map it) and what the highest-RSS
moment was made of (``benchmarks/memory_probe.py``): the process before the model (imports, process
group; and the malloc bytes in use of it), malloc's bytes in use, the free bytes its heaps keep (allocator
slack), the freed large blocks kept for reuse (``slipstream/ops/large_blocks.py``), shared-memory
collective mappings and transparent huge pages. Beside each: the saving below DDP's peak RSS against
the model-state formula's (16Ψ bytes for fp32 AdamW, less each stage's share; ``slipstream.estimator``)
and the estimator's peak (the process before the model + model states + activations + the same-host collectives'
rings, ``estimate(..., on_cpu=True)``).

Every configuration runs as a fresh 2-rank job (gloo, one thread per rank), so peak RSS is its own;
configurations alternate round by round (A B C ... A B C ...). All use AdamW(fused=True), lr 1e-3,
weight decay 0.01, gradient clipping 1.0, micro-batch 4, fp32, and the same JSON config for
slipstream and DeepSpeed (each with its own defaults for everything not set). DeepSpeed runs under
the interpreter given by --deepspeed-python (its own venv), or is skipped when none is given and it
is not importable here.
"""

from __future__ import annotations

import argparse
import ctypes
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
PEAK_STEPS = 3  # untimed steps under the memory sampler


def _config(stage: str) -> dict:
    zero: dict = {"stage": int(stage.removesuffix("+reuse"))}
    if stage.endswith("+reuse"):
        zero["stage3_max_reuse_distance"] = 1_000_000_000
    return {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0, "zero_optimization": zero}


def _worker(rank: int, world: int, port: int, kind: str, args: argparse.Namespace, out: str) -> None:
    import torch
    import torch.distributed as dist

    from benchmarks.common import (
        build_gpt2,
        lm_step,
        random_batches,
        setup_rank_env,
        time_steps,
        wrap_peer,
        write_rank_results,
    )
    from benchmarks.memory_probe import PeakSampler, sample, shm_rss_mib

    setup_rank_env(rank, world, port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    # The process before the model: its libraries loaded too (transformers alone is ~164 MiB of RSS), so that what
    # the estimate adds to it is the model's states and activations
    from transformers import GPT2LMHeadModel  # noqa: F401

    import slipstream  # noqa: F401

    before = sample()
    before_model = before["rss"]
    model = build_gpt2(args.model)
    psi = sum(p.numel() for p in model.parameters())
    batches = random_batches(WARMUP + args.steps + PEAK_STEPS, seed=rank)
    engine = None

    def adamw(params: object) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True)

    if kind in ("ddp", "fsdp2"):
        wrapped = wrap_peer(kind, model, model.transformer.h)
        step = lm_step(wrapped, adamw(wrapped.parameters()))
    else:
        framework, stage = kind.split("-", 1)
        if stage.endswith("+sockets"):  # the same-host shared-memory collectives off (slipstream/comm/shm.py)
            os.environ["SLIPSTREAM_SHM_COLLECTIVES"] = "0"
            stage = stage.removesuffix("+sockets")
        trim_each_step = stage.endswith("+trim")  # glibc's free heap pages returned after every step
        stage = stage.removesuffix("+trim")
        if stage.endswith("+4m"):  # blocks from 4 MiB on mappings of their own (ops/large_blocks.py; default 1 MiB)
            os.environ["SLIPSTREAM_LARGE_BLOCKS"] = str(4 << 20)
            stage = stage.removesuffix("+4m")
        if stage.endswith("+glibc"):  # every CPU block from glibc's malloc (slipstream/ops/large_blocks.py off)
            os.environ["SLIPSTREAM_LARGE_BLOCKS"] = "0"
            stage = stage.removesuffix("+glibc")
        offloaded = "+" in stage.removesuffix(
            "+reuse"
        )  # bench_offload's JSON: the optimizer comes from the config (CPU Adam offloaded)
        if offloaded:
            from benchmarks.bench_offload import config_for

            config = config_for(stage, args.nvme_path)
        else:
            config = _config(stage)
        if framework == "slipstream":
            import slipstream

            engine = slipstream.initialize(model, config, optimizer=None if offloaded else adamw)
        else:
            import deepspeed

            if offloaded:
                engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
            else:
                config = {**config, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
                engine, *_ = deepspeed.initialize(model=model, optimizer=adamw(model.parameters()), config=config)

        def step(batch: torch.Tensor) -> None:
            loss = engine(input_ids=batch, labels=batch).loss
            engine.backward(loss)
            engine.step()
            if trim_each_step:
                ctypes.CDLL("libc.so.6").malloc_trim(0)

    times = time_steps(step, batches[: WARMUP + args.steps], WARMUP)
    with PeakSampler() as peak:
        for batch in batches[WARMUP + args.steps :]:
            step(batch)
    held = {}
    if engine is not None and hasattr(engine, "strategy") and hasattr(engine.strategy, "memory_breakdown"):
        held = {k: v / 2**20 for k, v in engine.strategy.memory_breakdown().items()}
    extra = {
        "psi": psi,
        "before_model": before_model,
        "malloc_before_model": before.get("heap_used", 0.0) + before.get("mmapped", 0.0),
        "at_peak": peak.at_rss,
        "pss": peak.pss,
        "live": peak.live,
        "shm": shm_rss_mib(),
        "held": held,
    }
    write_rank_results(out, times, extra)
    dist.destroy_process_group()


def run_worker(kind: str, args: argparse.Namespace) -> None:
    import torch.multiprocessing as mp

    from benchmarks.common import free_port

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    mp.spawn(_worker, args=(args.world, free_port(), kind, args, args.out), nprocs=args.world)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2-large")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--world", type=int, default=2, help="ranks (gloo, one thread each)")
    parser.add_argument("--stages", default="0,1,2")
    parser.add_argument("--peers", default="ddp", help="torch peers besides DDP: fsdp2")
    parser.add_argument("--deepspeed-python", default=None)
    parser.add_argument("--deepspeed-stages", default=None, help="the stages DeepSpeed runs (default: --stages)")
    parser.add_argument("--nvme-path", default="/tmp")
    parser.add_argument(
        "--thp",
        choices=("0", "1"),
        default="1",
        help="THP_MEM_ALLOC_ENABLE for every framework: 1 as `slipstream run` sets it, 0 as plain torchrun leaves it",
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker(args.worker, args)
        return

    stages = args.stages.split(",")
    deepspeed_python = args.deepspeed_python or (sys.executable if importlib.util.find_spec("deepspeed") else None)
    kinds = ["ddp", *(p for p in args.peers.split(",") if p and p != "ddp")] + [f"slipstream-{s}" for s in stages]
    if deepspeed_python:
        kinds += [f"deepspeed-{s}" for s in (args.deepspeed_stages.split(",") if args.deepspeed_stages else stages)]
    results: dict[str, dict[str, list]] = {k: {"times": [], "rss": [], "rounds": [], "extra": []} for k in kinds}
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
                    "--world",
                    str(args.world),
                    "--nvme-path",
                    args.nvme_path,
                ]
                # Huge pages for large CPU tensors (as `slipstream run` sets them) or not, for every framework alike.
                env = {**os.environ, "THP_MEM_ALLOC_ENABLE": args.thp, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu"}
                subprocess.run(
                    command, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
                data = json.loads(Path(out.name).read_text())
            results[kind]["times"] += data["times"]
            results[kind]["rounds"].append(statistics.median(data["times"]))
            results[kind]["rss"] = [max(a, b) for a, b in zip(results[kind]["rss"], data["rss"])] or data["rss"]
            results[kind]["extra"].append(data["extra"])

    ddp = statistics.median(results["ddp"]["times"])
    print(
        f"{args.model}, {args.world} ranks (gloo, 1 thread each), fp32, AdamW(fused=True), clip 1.0, micro-batch 4;"
        f" {args.rounds} alternating rounds x {args.steps} steps; THP_MEM_ALLOC_ENABLE={args.thp}"
    )
    fsdp2 = statistics.median(results["fsdp2"]["times"]) if "fsdp2" in results else None
    print(
        f"{'config':<14} {'median ms':>9} {'min-max ms':>15} {'peak RSS/rank MB':>18} {'vs DDP':>7} {'vs DeepSpeed':>13}"
        + (f" {'vs FSDP2':>9}" if fsdp2 else "")
    )
    for kind in kinds:
        times = sorted(t * 1e3 for t in results[kind]["times"])
        median = statistics.median(times)
        rss = "/".join(f"{r:.0f}" for r in results[kind]["rss"])
        peer = kind.replace("slipstream", "deepspeed")
        peer = (
            peer.removesuffix("+sockets").removesuffix("+glibc").removesuffix("+4m").removesuffix("+trim")
        )  # DeepSpeed has none
        if peer not in results:  # DeepSpeed's stage 3 defaults to the 1e9 reuse distance: its 3 is our 3+reuse
            peer = peer.removesuffix("+reuse")
        vs_ds = ""
        if kind.startswith("slipstream") and peer in results:
            vs_ds = f"{median / (statistics.median(results[peer]['times']) * 1e3):.3f}x"
        vs_fsdp2 = f" {median / (fsdp2 * 1e3):8.3f}x" if fsdp2 and kind.startswith("slipstream") else ""
        print(
            f"{kind:<14} {median:9.1f} {times[0]:7.1f}-{times[-1]:<7.1f} {rss:>18} {median / (ddp * 1e3):6.3f}x {vs_ds:>13}{vs_fsdp2}"
        )
    # The machine's speed drifts between rounds; a ratio within one round (neighbouring jobs) drifts less.
    print("per round, each config's median step over DDP's in the same round (the median of these):")
    for kind in kinds[1:]:
        paired = [a / b for a, b in zip(results[kind]["rounds"], results["ddp"]["rounds"])]
        print(f"  {kind:<14} {' '.join(f'{r:.3f}' for r in paired)}  median {statistics.median(paired):.3f}x")

    print_memory(kinds, results, args.world, args.model)


def _stage_of(kind: str) -> int | None:
    """The ZeRO stage whose formula a configuration is held to (DDP: stage 0); None for what no formula covers."""
    if kind in ("ddp", "fsdp2"):
        return 0 if kind == "ddp" else 3
    stage = kind.split("-", 1)[1]
    return int(stage[0]) if stage[0].isdigit() and "+cpu" not in stage and "+nvme" not in stage else None


def print_memory(kinds: list[str], results: dict[str, dict[str, list]], world: int, model: str) -> None:
    """Peak RSS and PSS per rank, what the peak was made of, the saving against the formula's, the estimator's peak."""
    from benchmarks.common import MICRO_BATCH, MODELS, SEQ, VOCAB, build_gpt2
    from slipstream.estimator import Stage3Layout, estimate, host_rings
    from slipstream.estimator_measure import measure_activations, stage3_gathered_params
    from slipstream.utils.host_rings import PIECE_BYTES

    mib = 2**20
    worst = {
        k: max((r for extra in results[k]["extra"] for r in extra), key=lambda r: r["at_peak"].get("rss", 0.0))
        for k in kinds
    }
    psi = worst[kinds[0]]["psi"]
    shape = MODELS[model]
    built = build_gpt2(model)  # activations measured on fake tensors, units as stage 3 cuts them (estimator_measure.py)
    plain = estimate(psi, world, precision="fp32")
    found = estimate(
        psi,
        world,
        seq_len=SEQ,
        micro_batch=MICRO_BATCH,
        precision="fp32",
        layers=shape["n_layer"],
        hidden=shape["n_embd"],
        heads=shape["n_head"],
        vocab=VOCAB,
        flash_attention=True,
        activations=measure_activations(built, SEQ, MICRO_BATCH, "fp32"),
        layout=Stage3Layout(gathered=stage3_gathered_params(built)),
        on_cpu=True,  # the same-host collectives' shared files and scratch rows (utils/host_rings.py)
    )
    ddp_peak = max(results["ddp"]["rss"])  # peak per rank: the largest rank's, what a user provisions for
    print(
        "MiB per rank (2^20 bytes). Saving: the largest rank's peak RSS below DDP's largest, against the model states'"
        f" formula (stage 0 less stage N, fp32 AdamW: 16·Ψ = {16 * psi / mib:.0f} MiB at Ψ = {psi / 1e6:.1f}M)"
    )
    print(
        f"{'config':<14} {'peak RSS':>9} {'peak PSS':>9} {'saving':>7} {'formula':>8} {'ratio':>6}   at the highest RSS: {'before model':>12}"
        f" {'(malloc)':>8} {'malloc used':>11} {'heap free':>9} {'cached':>6} {'shm':>5} {'huge':>5}   estimate {'error':>6}"
        f"   {'peak live':>9} {'estimate':>8} {'error':>6}"
        "   engine holds (params/grads/optimizer/buffers)"
    )
    for kind in kinds:
        w, stage = worst[kind], _stage_of(kind)
        at = w["at_peak"]
        peak = max(results[kind]["rss"])
        saving = ddp_peak - peak
        formula = ratio = est = error = est_live = error_live = ""
        live = max(r.get("live", 0.0) for e in results[kind]["extra"] for r in e)
        if stage is not None:
            # the formula: model states only (stage 2's with its two send buffers, slipstream/estimator.py)
            states = plain.stage(0).model_states - plain.stage(stage).model_states
            formula = f"{states / mib:.0f}"
            ratio = f"{saving / (states / mib):.2f}" if states else ""
            estimated = found.stage(stage).total / mib
            predicted = w["before_model"] + estimated
            est, error = f"{predicted:.0f}", f"{peak / predicted - 1:+.0%}"
            # the allocators' bytes handed out (sampled every 5 ms) against the malloc bytes before the model + the
            # estimate: what the estimate models, without the memory the allocators keep free (heap, cache) and
            # without the rings' shared files (shared memory, not the allocators'; their scratch rows are)
            shared_files = sum(2 * PIECE_BYTES for size in host_rings(stage, world, found.layout) if size > 1)
            predicted_live = w.get("malloc_before_model", 0.0) + estimated - shared_files / mib
            est_live, error_live = f"{predicted_live:.0f}", f"{live / predicted_live - 1:+.0%}"
        held = "/".join(f"{w['held'][k]:.0f}" for k in ("params", "grads", "optimizer", "buffers") if k in w["held"])
        print(
            f"{kind:<14} {peak:9.0f} {max(r['pss'] for e in results[kind]['extra'] for r in e):9.0f} {saving:7.0f} {formula:>8} {ratio:>6}"
            f"   {'':>18}{w['before_model']:12.0f} {w.get('malloc_before_model', 0):8.0f}"
            f" {at.get('heap_used', 0) + at.get('mmapped', 0):11.0f} {at.get('heap_free', 0):9.0f} {at.get('large_cached', 0):6.0f}"
            f" {w['shm']:5.0f} {at.get('huge', 0):5.0f}   {est:>8} {error:>6}   {live:9.0f} {est_live:>8} {error_live:>6}"
            f"   {held}"
        )


if __name__ == "__main__":
    main()
