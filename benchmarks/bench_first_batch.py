"""What the twin check on the first real batch costs: the first step with it and without it, at 4k tokens.

    python benchmarks/bench_first_batch.py [--rounds 3] [--tokens 4096] [--modes ulysses,zigzag] [--sliding-window N]

Model: a Llama from a config (4 layers, hidden 256, 8 heads, 4 KV heads, vocabulary 8192, 3.9M
parameters), fp32, AdamW, one micro-batch of 1 × ``tokens`` tokens, right-padded by 10% (an SFT
row: attention_mask and labels -100 at the padding), 2 ranks on gloo, one thread each. Modes:
``ulysses`` (``sequence_parallel_size`` 2) and ``zigzag`` (``context_parallel`` 2, zig-zag). Each
job is a fresh pair of processes; the first step is timed from ``engine(batch)`` to the end of
``engine.step()``, with the first-batch check (A) or with it switched off after ``initialize``
(B, the synthetic check at ``initialize`` runs in both). Jobs alternate A B A B; the table gives
medians and the check's share of the first step, (A − B) / B. ``--sliding-window N``: the same shape as a Mistral
with an N-token sliding window, where the check's window grows to N + 96 tokens to cross it (first_batch.py,
[Note: a window that crosses the model's ranges]).
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
from benchmarks.common import alternate_on_off, setup_rank_env  # noqa: E402

MODES = {"ulysses": {"sequence_parallel_size": 2}, "zigzag": {"context_parallel": {"size": 2, "method": "zigzag"}}}


def _worker(rank: int, mode: str, check: bool, tokens: int, window: int, port: int, out: str) -> None:
    import torch

    setup_rank_env(rank, 2, port)
    torch.set_num_threads(1)
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    import slipstream

    torch.manual_seed(0)
    shape = dict(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=tokens,
        attn_implementation="sdpa",
    )
    model = (
        MistralForCausalLM(MistralConfig(**shape, sliding_window=window))
        if window
        else LlamaForCausalLM(LlamaConfig(**shape))
    )
    ids = torch.randint(0, 8192, (1, tokens), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[:, tokens - tokens // 10 :] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    engine = slipstream.initialize(
        model,
        {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_clipping": 1.0,
            "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            **MODES[mode],
        },
    )
    if not check:
        engine.runner.sharder.take_first_batch_check()
    start = time.perf_counter()
    loss = engine(**batch).loss
    engine.backward(loss)
    engine.step()
    first = time.perf_counter() - start
    start = time.perf_counter()
    loss = engine(**batch).loss
    engine.backward(loss)
    engine.step()
    second = time.perf_counter() - start
    engine.destroy()
    if rank == 0:
        Path(f"{out}.{rank}").write_text(json.dumps({"first": first, "second": second}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--modes", default="ulysses,zigzag")
    parser.add_argument("--sliding-window", type=int, default=0, help="a Mistral with this window instead of the Llama")
    args = parser.parse_args()
    modes = args.modes.split(",")
    found = alternate_on_off(_worker, modes, args.rounds, args.tokens, args.sliding_window)
    model = f"Mistral 3.9M (sliding window {args.sliding_window})" if args.sliding_window else "Llama 3.9M"
    print(
        f"{model}, 1 × {args.tokens} tokens (10% padding), 2 ranks, medians of {args.rounds} alternating rounds (fresh jobs)"
    )
    print(f"{'mode':<10}{'first-batch check':<19}{'first step s':>14}{'second step s':>15}{'check / first step':>20}")
    for mode in modes:
        first = {c: statistics.median(r["first"] for r in found[(mode, c)]) for c in (True, False)}
        for check in (True, False):
            second = statistics.median(r["second"] for r in found[(mode, check)])
            share = f"{(first[True] - first[False]) / first[False]:.1%}" if check else ""
            print(f"{mode:<10}{'on' if check else 'off':<19}{first[check]:>14.3f}{second:>15.3f}{share:>20}")


if __name__ == "__main__":
    main()
