"""The composition recipes at world 4 beside the same model at dp 4 ZeRO-3: tokens/s and peak RSS per rank.

    python benchmarks/bench_recipes.py [--steps 4] [--rounds 2] [--only deepseek-dualpipev,moe-dp4-z3]

Every configuration trains the same global batch, 8 sequences of 256 tokens per optimizer step, on
4 gloo ranks (fp32, AdamW, one intra-op thread per rank), each run a fresh 4-process job so its peak
RSS is its own; configurations alternate within every round (A B C … A B C …) and the table gives
medians over rounds and the median of the per-round ratios against the baseline of the same model.

* MoE model (Mixtral-shaped: hidden 256, 8 layers, 8 experts of intermediate 512, top-2, GQA 8/4,
  vocab 4096), **DeepSeek-V3's recipe**: pp 2 × ep 2 × dp 2, ZeRO-1, 4 micro-batches of 1 per dp
  rank, with 1F1B and with DualPipeV (a V of four 2-layer stages, expert all-to-alls overlapped
  with the paired micro-batch's compute; ``-in-turn``: the same pairs with every all-to-all waited on
  in place, to measure what the overlap buys); baseline ``moe-dp4-z3``.
* Dense Llama (hidden 256, 8 layers, GQA 8/4, intermediate 688, vocab 4096): **Llama 3's** axes that
  fit 4 ranks, tp 2 × cp 2 (ring attention), micro-batch 8; **USP**, Ulysses 2 × ring 2, micro-batch
  8; baseline ``llama-dp4-z3`` (micro-batch 2 per rank).

The pipeline runs keep ``wall_clock_breakdown`` on so each rank's measured bubble (its idle time over
its compute from one common start to the slowest rank's end) is comparable with the simulator's
prediction for the same measured pass costs; the table prints both for every rank. On 2 cores four
processes share the CPU, so the absolute tokens/s say little and the ratios compare the layouts'
overheads (communication, bubbles, replication), not their memory-bound speed on real devices.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.common import peak_rss_mb, setup_rank_env, spawn_ranks  # noqa: E402

SEQ, VOCAB, GLOBAL, WORLD = 256, 4096, 8, 4
ADAMW = {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}}
EP2 = {"expert_parallel": {"enabled": True, "autoep_size": 2}}

# name -> (model, micro-batch per rank, accumulation, extra config); micro · accumulation · dp = GLOBAL
CONFIGS: dict[str, tuple[str, int, int, dict[str, Any]]] = {
    "moe-dp4-z3": ("moe", 2, 1, {"zero_optimization": {"stage": 3}}),
    "deepseek-1f1b": (
        "moe",
        1,
        4,
        {
            **EP2,
            "zero_optimization": {"stage": 1},
            "wall_clock_breakdown": True,
            "pipeline": {"stages": 2, "schedule": "1f1b"},
        },
    ),
    "deepseek-dualpipev": (
        "moe",
        1,
        4,
        {
            **EP2,
            "zero_optimization": {"stage": 1},
            "wall_clock_breakdown": True,
            "pipeline": {"stages": 2, "schedule": "dualpipev", "virtual_stages": 2},
        },
    ),
    # The same pairs with the all-to-alls waited on in place (no hand-over): what the overlap buys.
    "deepseek-dualpipev-in-turn": (
        "moe",
        1,
        4,
        {
            **EP2,
            "zero_optimization": {"stage": 1},
            "wall_clock_breakdown": True,
            "pipeline": {"stages": 2, "schedule": "dualpipev", "virtual_stages": 2},
        },
    ),
    "llama-dp4-z3": ("llama", 2, 1, {"zero_optimization": {"stage": 3}}),
    "llama3-tp2-cp2": (
        "llama",
        8,
        1,
        {"tensor_parallel": {"autotp_size": 2}, "context_parallel": {"size": 2}, "zero_optimization": {"stage": 1}},
    ),
    "usp-sp2-cp2": (
        "llama",
        8,
        1,
        {"sequence_parallel_size": 2, "context_parallel": {"size": 2}, "zero_optimization": {"stage": 1}},
    ),
}
BASELINE = {"moe": "moe-dp4-z3", "llama": "llama-dp4-z3"}


def _model(kind: str) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    common = dict(
        num_hidden_layers=8,
        hidden_size=256,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="sdpa",
    )
    if kind == "moe":
        return MixtralForCausalLM(
            MixtralConfig(intermediate_size=512, num_local_experts=8, num_experts_per_tok=2, **common)
        )
    return LlamaForCausalLM(LlamaConfig(intermediate_size=688, **common))


def _worker(rank: int, name: str, steps: int, port: int, out: str) -> None:
    setup_rank_env(rank, WORLD, port)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    import slipstream

    kind, micro, accumulation, extra = CONFIGS[name]
    if name.endswith("-in-turn"):
        from slipstream.comm import overlap

        overlap.wait = lambda work: work.wait()  # the expert dispatch's waits no longer hand the turn over
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "optimizer": ADAMW,
        **extra,
    }
    engine = slipstream.initialize(_model(kind), config)
    dp, d = engine.mesh.size("dp"), engine.mesh.rank_of("dp")
    g = torch.Generator().manual_seed(1)
    times, bubbles, overlapped = [], [], []
    for step in range(steps + 1):
        tokens = torch.randint(0, VOCAB, (GLOBAL, SEQ), generator=g)
        dist.barrier()
        started = time.perf_counter()
        for i in range(accumulation):
            rows = tokens[(i * dp + d) * micro : (i * dp + d + 1) * micro]
            engine.backward(engine(input_ids=rows, labels=rows).loss)
            engine.step()
        dist.barrier()
        if step:  # the first step builds buffers and warms the allocator
            times.append(time.perf_counter() - started)
            report = engine.pipeline.last_report if engine.pipeline is not None else None
            if report is not None and report.timing is not None:
                bubbles.append((report.timing.bubble, report.predicted_bubble))
                overlapped.append(report.timing.overlapped)
    engine.close()
    result = {
        "ms": statistics.median(times) * 1e3,
        "rss_mb": peak_rss_mb(),
        "bubbles": bubbles,
        "overlapped": overlapped,
    }
    Path(f"{out}.{rank}").write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--only", default="", help="comma-separated configurations (default: all)")
    args = parser.parse_args()
    names = [n for n in CONFIGS if not args.only or n in args.only.split(",")]
    runs: dict[str, list[list[dict]]] = {n: [] for n in names}
    for _ in range(args.rounds):
        for name in names:
            ranks = spawn_ranks(_worker, name, args.steps, world=WORLD)
            if len(ranks) < WORLD:
                raise SystemExit(f"{name}: only {len(ranks)} of {WORLD} ranks reported")
            runs[name].append(ranks)
    tokens = GLOBAL * SEQ
    print(
        f"world {WORLD} on gloo, {GLOBAL}×{SEQ} tokens per step, {args.rounds} alternating rounds × {args.steps} steps (medians)"
    )
    print(f"{'config':<26} {'ms/step':>8} {'tokens/s':>9} {'vs dp4 ZeRO-3':>14} {'peak RSS MB (per rank)':>24}")
    for name in names:
        ms = statistics.median(r[0]["ms"] for r in runs[name])
        rss = [statistics.median(r[k]["rss_mb"] for r in runs[name]) for k in range(WORLD)]
        base = BASELINE[CONFIGS[name][0]]
        ratio = ""
        if base in runs and base != name:  # per round: this config's time over the baseline's of the same round
            ratio = f"{statistics.median(a[0]['ms'] / b[0]['ms'] for a, b in zip(runs[name], runs[base])):.3f}x time"
        print(f"{name:<26} {ms:8.0f} {tokens / ms * 1e3:9.0f} {ratio:>14} {' '.join(f'{x:5.0f}' for x in rss):>24}")
    for name in names:
        if not runs[name][0][0]["bubbles"]:
            continue
        print(f"{name}: bubble measured / simulator per rank (medians over steps and rounds)")
        for k in range(WORLD):
            measured = statistics.median(b[0] for r in runs[name] for b in r[k]["bubbles"])
            predicted = statistics.median(b[1] for r in runs[name] for b in r[k]["bubbles"])
            hidden = statistics.median(x for r in runs[name] for x in r[k]["overlapped"])
            print(
                f"  rank {k}: {measured:.3f} / {predicted:.3f} (difference {measured - predicted:+.3f}); "
                f"all-to-alls overlapped per step {hidden:.0f}"
            )


if __name__ == "__main__":
    main()
