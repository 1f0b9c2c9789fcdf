"""Tensor parallel 2 vs ZeRO-3 over dp 2 (and DeepSpeed AutoTP where it trains): step time, memory, capacity.

    python benchmarks/bench_tensor_parallel.py [--steps 6] [--rounds 2] [--hidden 512]
                                               [--capacity 512,768,1024] [--cap-gb 1.5]
                                               [--deepspeed-python /work/ds-venv/bin/python]

Model: the gpt2-large shape of BENCHMARKS.md as a Llama (``LlamaForCausalLM``): 8 layers, hidden
512, 8 heads (head 64), MLP 8h/3 (rounded to 64, Llama's usual ratio, so the MLP holds what GPT-2's
4h does), vocab 8192, seq 128, micro-batch 4, fp32, AdamW lr 1e-3, clip 1.0, 2 ranks (gloo, one
thread each). Configurations: ``tp2`` (tensor_parallel.autotp_size 2, ZeRO 0: one model split over
the two ranks, both see the same micro-batch), ``zero3`` (dp 2, ZeRO-3: each rank its own
micro-batch, so it processes twice the tokens per step; the ms per step and ms per token are both
printed), ``ds-autotp`` (DeepSpeed's AutoTP training with ZeRO 1, in its own venv).

Each configuration is a fresh 2-rank job (so peak RSS is its own); configurations alternate round
by round (A B C A B C). Capacity: for each hidden size in --capacity (layers 8, heads h/64), a job
under ``RLIMIT_DATA = --cap-gb`` GiB per rank trains 3 steps or fails; the largest that trains is
printed per configuration. The whole model is built on every rank before it is cut (no meta-device
build for tp yet), so the peak includes one full fp32 copy in both configurations.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
WARMUP = 2
LAYERS, VOCAB, SEQ, MICRO = 8, 8192, 128, 4


def _llama(hidden: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    heads = hidden // 64
    config = LlamaConfig(
        num_hidden_layers=LAYERS,
        hidden_size=hidden,
        intermediate_size=(8 * hidden // 3 + 63) // 64 * 64,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        bos_token_id=0,
        eos_token_id=0,
    )
    return LlamaForCausalLM(config)


def _config(kind: str) -> dict:
    base = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
    }
    if kind == "tp2":
        return {**base, "tensor_parallel": {"autotp_size": 2}, "zero_optimization": {"stage": 0}}
    if kind == "zero3":
        return {**base, "zero_optimization": {"stage": 3}}
    return {**base, "tensor_parallel": {"autotp_size": 2}, "zero_optimization": {"stage": 1}}  # ds-autotp


def _worker(rank: int, world: int, port: int, kind: str, hidden: int, steps: int, cap_gb: float, out: str) -> None:
    import torch
    import torch.distributed as dist

    from benchmarks.common import current_rss_mb, setup_rank_env, time_steps

    if cap_gb:
        cap = int(cap_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_DATA, (cap, resource.getrlimit(resource.RLIMIT_DATA)[1]))
    setup_rank_env(rank, world, port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = _llama(hidden)
    if kind.startswith("ds"):
        import deepspeed

        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(kind))
    else:
        import slipstream

        engine = slipstream.initialize(model, _config(kind))
    generator = torch.Generator().manual_seed(0 if kind != "zero3" else rank)  # tp ranks share a micro-batch
    batches = [torch.randint(0, VOCAB, (MICRO, SEQ), generator=generator) for _ in range(WARMUP + steps)]

    def step(batch: torch.Tensor) -> None:
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()

    times = time_steps(step, batches, WARMUP)
    from benchmarks.common import peak_rss_mb

    rss = torch.tensor([peak_rss_mb(), current_rss_mb()])
    gathered = [torch.zeros(2) for _ in range(world)]
    dist.all_gather(gathered, rss)
    if rank == 0:
        Path(out).write_text(
            json.dumps(
                {"times": times, "peak": [float(g[0]) for g in gathered], "end": [float(g[1]) for g in gathered]}
            )
        )
    dist.barrier()
    dist.destroy_process_group()


def _run(python: str, kind: str, hidden: int, steps: int, cap_gb: float) -> dict | None:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [
            python,
            __file__,
            "--worker",
            kind,
            "--hidden",
            str(hidden),
            "--steps",
            str(steps),
            "--cap-gb",
            str(cap_gb),
            "--out",
            out.name,
        ]
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "DS_ACCELERATOR": "cpu",
            "MALLOC_ARENA_MAX": "2",
            "THP_MEM_ALLOC_ENABLE": "1",
        }
        done = subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode != 0:
            return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
        return json.loads(Path(out.name).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--capacity", default="", help="hidden sizes to try under --cap-gb, e.g. 512,768,1024")
    parser.add_argument("--cap-gb", type=float, default=0.0, help="RLIMIT_DATA per rank (GiB) for the capacity search")
    parser.add_argument("--deepspeed-python", default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        import torch.multiprocessing as mp

        from benchmarks.common import free_port

        mp.spawn(_worker, args=(2, free_port(), args.worker, args.hidden, args.steps, args.cap_gb, args.out), nprocs=2)
        return

    kinds = ["tp2", "zero3"] + (["ds-autotp"] if args.deepspeed_python else [])
    python = {k: args.deepspeed_python if k.startswith("ds") else sys.executable for k in kinds}
    results: dict[str, dict] = {k: {"times": [], "peak": [], "end": [], "error": None} for k in kinds}
    for _ in range(args.rounds):
        for kind in kinds:
            data = _run(python[kind], kind, args.hidden, args.steps, 0.0)
            if "error" in data:
                results[kind]["error"] = data["error"]
                continue
            results[kind]["times"] += data["times"]
            results[kind]["peak"] = [max(a, b) for a, b in zip(results[kind]["peak"], data["peak"])] or data["peak"]
            results[kind]["end"] = data["end"]
    print(
        f"Llama h {args.hidden}, {LAYERS} layers, vocab {VOCAB}, seq {SEQ}, micro-batch {MICRO}, fp32, 2 ranks (gloo, 1 thread each);"
        f" {args.rounds} alternating rounds x {args.steps} steps"
    )
    print(
        f"{'config':<10} {'median ms':>9} {'ms/1k tokens':>12} {'peak RSS/rank MB':>17} {'end RSS/rank MB':>16} {'vs zero3':>9}"
    )
    base = statistics.median(results["zero3"]["times"]) if results["zero3"]["times"] else None
    for kind in kinds:
        r = results[kind]
        if not r["times"]:
            print(f"{kind:<10} failed: {r['error']}")
            continue
        median = statistics.median(r["times"]) * 1e3
        tokens = MICRO * SEQ * (2 if kind == "zero3" else 1)
        vs = f"{median / (base * 1e3):.3f}x" if base else ""
        print(
            f"{kind:<10} {median:9.1f} {median / tokens * 1e3:12.1f} {'/'.join(f'{x:.0f}' for x in r['peak']):>17} {'/'.join(f'{x:.0f}' for x in r['end']):>16} {vs:>9}"
        )
    if results["tp2"]["times"] and "ds-autotp" in results and results["ds-autotp"]["times"]:
        ratio = statistics.median(results["tp2"]["times"]) / statistics.median(results["ds-autotp"]["times"])
        print(f"tp2 vs DeepSpeed AutoTP (same tokens per step): {ratio:.3f}x")
    if args.capacity:
        print(f"capacity under RLIMIT_DATA {args.cap_gb} GiB per rank ({WARMUP + 1} steps):")
        for kind in kinds:
            largest = None
            for hidden in (int(h) for h in args.capacity.split(",")):
                data = _run(python[kind], kind, hidden, 1, args.cap_gb)
                ok = "error" not in data
                print(
                    f"  {kind:<10} h {hidden:>5}: {'trains' if ok else 'fails (' + data['error'][:80] + ')'}"
                    + (f", peak RSS/rank {'/'.join(f'{x:.0f}' for x in data['peak'])} MB" if ok else "")
                )
                if not ok:
                    break
                largest = hidden
            print(f"  {kind}: largest hidden that trains: {largest}")


if __name__ == "__main__":
    main()
