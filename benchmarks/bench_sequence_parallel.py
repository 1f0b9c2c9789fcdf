"""Long sequences on 2 ranks: Ulysses, ring, zig-zag ring and all-gathered K/V against plain dp 2.

    python benchmarks/bench_sequence_parallel.py [--seq 2048] [--steps 4] [--rounds 3] [--cap-gb 1.0]

Model: Llama (``LlamaForCausalLM``) hidden 256, 4 layers, 4 heads (head 64), 4 KV heads, vocab
4096, fp32, AdamW, ZeRO 1, micro-batch 1, gloo on CPU. ``dp2``: each rank trains its own sequence
(2 sequences per step); ``sp2`` (Ulysses), ``ring2``, ``zigzag2``, ``allgather2``: both ranks
share one sequence (1 per step). Printed per configuration: median ms per step, tokens per second
(over both ranks) and its ratio to dp2, the activation bytes autograd saves for backward per rank
for one micro-batch (saved-tensor hooks, weights excluded), and from it the longest sequence whose
saved activations fit in ``--cap-gb`` per rank (attention is flash-style everywhere, so saved
bytes grow linearly with the sequence). Configurations alternate round by round (A B C D E, ...),
each round a fresh 2-rank job; medians over rounds.
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
from benchmarks.common import setup_rank_env, spawn_ranks  # noqa: E402

KINDS = {
    "dp2": {},
    "sp2": {"sequence_parallel_size": 2},
    "ring2": {"context_parallel": {"size": 2, "method": "ring"}},
    "zigzag2": {"context_parallel": {"size": 2, "method": "zigzag"}},
    "allgather2": {"context_parallel": {"size": 2, "method": "allgather_kv"}},
}


def _model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            num_hidden_layers=4,
            hidden_size=256,
            intermediate_size=704,
            num_attention_heads=4,
            num_key_value_heads=4,
            vocab_size=4096,
            max_position_embeddings=1 << 16,
            bos_token_id=0,
            eos_token_id=0,
            attn_implementation="sdpa",
        )
    )


def _worker(rank: int, kind: str, seq: int, steps: int, port: int, out: str) -> None:
    setup_rank_env(rank, 2, port)
    import torch

    torch.set_num_threads(1)
    import slipstream

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 1},
        **KINDS[kind],
    }
    engine = slipstream.initialize(_model(), config)
    shared = kind != "dp2"
    g = torch.Generator().manual_seed(0 if shared else rank)
    times = []
    for step in range(steps + 1):
        tokens = torch.randint(0, 4096, (1, seq), generator=g)
        started = time.perf_counter()
        engine.backward(engine(input_ids=tokens, labels=tokens).loss)
        engine.step()
        if step:  # the first step warms up
            times.append(time.perf_counter() - started)
    from slipstream.engine.monitor.activations import saved_activation_bytes

    saved = saved_activation_bytes(lambda: engine(input_ids=tokens, labels=tokens).loss, engine.module.parameters())
    engine.close()
    if rank == 0:
        tokens_per_step = seq * (1 if shared else 2)
        Path(f"{out}.0").write_text(
            json.dumps({"ms": statistics.median(times) * 1e3, "tokens_per_step": tokens_per_step, "saved": saved})
        )


def _run(kind: str, seq: int, steps: int) -> dict:
    return spawn_ranks(_worker, kind, seq, steps)[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cap-gb", type=float, default=1.0)
    parser.add_argument("--kinds", default=",".join(KINDS))
    args = parser.parse_args()
    kinds = args.kinds.split(",")
    results: dict[str, list[dict]] = {k: [] for k in kinds}
    for _ in range(args.rounds):  # A B C ... alternating, a fresh job each
        for kind in kinds:
            results[kind].append(_run(kind, args.seq, args.steps))
    base = None
    print(
        f"seq {args.seq}, 2 ranks, {args.rounds} rounds (medians); capacity = longest sequence whose saved activations fit {args.cap_gb} GiB/rank"
    )
    print(f"{'config':<11} {'ms/step':>8} {'tokens/s':>9} {'vs dp2':>7} {'saved MB/rank':>14} {'longest seq':>12}")
    for kind in kinds:
        ms = statistics.median(r["ms"] for r in results[kind])
        tps = results[kind][0]["tokens_per_step"] / ms * 1e3
        base = base or tps
        saved = statistics.median(r["saved"] for r in results[kind])
        longest = int(args.cap_gb * 2**30 / (saved / args.seq))
        print(f"{kind:<11} {ms:8.0f} {tps:9.0f} {tps / base:6.2f}x {saved / 2**20:14.1f} {longest:12d}")


if __name__ == "__main__":
    main()
