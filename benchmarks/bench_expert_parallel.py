"""Expert parallel 2 vs replicated experts (dp 2, ZeRO-2) on a Mixtral: tokens/s and peak RSS per rank.

    python benchmarks/bench_expert_parallel.py [--steps 4] [--rounds 3] [--experts 16]

Model: ``MixtralForCausalLM`` hidden 256, 4 layers, 4 heads, ``--experts`` experts of intermediate
512, top-2, vocab 4096, seq 256, micro-batch 2, fp32, AdamW, ZeRO 2, 2 ranks on gloo. ``ep2``:
expert_parallel.autoep_size 2 (each rank holds half the experts, tokens dispatched by all-to-all);
``dp2``: every rank holds every expert (ZeRO-2 shards their optimizer state and gradients). Both
train the same tokens per step. Configurations alternate round by round, each a fresh 2-rank job
(peak RSS is its own); medians over rounds. DeepSpeed's MoE layer is not run side by side: it
needs the model rewritten around its layer and drops tokens by default.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.common import current_rss_mb, peak_rss_mb, setup_rank_env, spawn_ranks  # noqa: E402

SEQ, MICRO, VOCAB = 256, 2, 4096


def _model(experts: int):
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(
        MixtralConfig(
            num_hidden_layers=4,
            hidden_size=256,
            intermediate_size=512,
            num_attention_heads=4,
            num_key_value_heads=4,
            num_local_experts=experts,
            num_experts_per_tok=2,
            vocab_size=VOCAB,
            max_position_embeddings=SEQ,
            bos_token_id=0,
            eos_token_id=0,
            attn_implementation="sdpa",
        )
    )


def _worker(rank: int, kind: str, experts: int, steps: int, port: int, out: str) -> None:
    setup_rank_env(rank, 2, port)
    import torch

    torch.set_num_threads(1)
    import slipstream

    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 2},
    }
    if kind == "ep2":
        config["expert_parallel"] = {"enabled": True, "autoep_size": 2}
    engine = slipstream.initialize(_model(experts), config)
    g = torch.Generator().manual_seed(rank)
    times = []
    for step in range(steps + 1):
        tokens = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
        started = time.perf_counter()
        engine.backward(engine(input_ids=tokens, labels=tokens).loss)
        engine.step()
        if step:
            times.append(time.perf_counter() - started)
    end = current_rss_mb()  # after training: what the run holds
    engine.close()
    rss = peak_rss_mb()  # includes building the whole model first
    Path(f"{out}.{rank}").write_text(json.dumps({"ms": statistics.median(times) * 1e3, "rss_mb": rss, "end_mb": end}))


def _run(kind: str, experts: int, steps: int) -> dict:
    ranks = spawn_ranks(_worker, kind, experts, steps)
    return {"ms": ranks[0]["ms"], "rss": [r["rss_mb"] for r in ranks], "end": [r["end_mb"] for r in ranks]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--experts", type=int, default=16)
    args = parser.parse_args()
    kinds = ["dp2", "ep2"]
    results: dict[str, list[dict]] = {k: [] for k in kinds}
    for _ in range(args.rounds):
        for kind in kinds:
            results[kind].append(_run(kind, args.experts, args.steps))
    tokens = 2 * MICRO * SEQ
    base = statistics.median(r["ms"] for r in results["dp2"])
    print(
        f"Mixtral h 256, 4 layers, {args.experts} experts top-2, seq {SEQ}, micro {MICRO}, 2 ranks, {args.rounds} rounds (medians)"
    )
    print(
        f"{'config':<6} {'ms/step':>8} {'tokens/s':>9} {'vs dp2':>7} {'peak RSS MB':>12} {'RSS after training MB':>22}"
    )
    for kind in kinds:
        ms = statistics.median(r["ms"] for r in results[kind])
        rss = [statistics.median(r["rss"][i] for r in results[kind]) for i in range(2)]
        end = [statistics.median(r["end"][i] for r in results[kind]) for i in range(2)]
        print(
            f"{kind:<6} {ms:8.0f} {tokens / ms * 1e3:9.0f} {base / ms:6.2f}x {rss[0]:5.0f} {rss[1]:5.0f} {end[0]:10.0f} {end[1]:10.0f}"
        )


if __name__ == "__main__":
    main()
