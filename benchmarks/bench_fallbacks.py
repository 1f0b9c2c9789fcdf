"""What the two fallbacks of issue 48 cost against the path they stand in for, on a model that takes both.

    python benchmarks/bench_fallbacks.py [--rounds 5] [--tokens 1024] [--hidden 256] [--layers 4]

A model whose attention no kernel reaches trains *blockwise* under a sequence mode (``sequence/blockwise.py``:
blocks on sequence shards, attention whole on every rank), and a model whose heads do not shard as tensor
parallel infers trains with its attention *gathered* (``tensor/parallelize.py``, [Note: gathered fallback]:
projections cut, attention whole). Llama runs both ways, so the price of each fallback is measured on it, 2 gloo
ranks (one thread each), batch 1, fp32, AdamW, the engine's whole step (forward, backward, step):

* Ulysses (the kernel: attention cut by heads) against blockwise (the kernels' refusal simulated by refusing the
  head check, the lever a model without the attention interface pulls), and one process beside them;
* tensor parallel with the inferred plan (heads cut; Llama's own plan set aside, the fallback is for inferred
  plans) against the attention group gathered (the self-check's first refusal simulated, as Falcon's fused
  Q|K|V gets).

Each variant builds its engine once; the rounds alternate A B A B in the same processes after a warm-up step.
Reported: medians of the slowest rank's step, the ratio fallback / preferred (above 1: the fallback is slower),
and the activations each rank saves for backward in one step (bytes through ``saved_tensors_hooks``: what
sharding divides).
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
from benchmarks.common import setup_rank_env, spawn_ranks  # noqa: E402

VARIANTS = {
    "ulysses": {"sequence_parallel_size": 2},
    "blockwise": {"sequence_parallel_size": 2},
    "tp": {"tensor_parallel": {"autotp_size": 2}},
    "tp gathered": {"tensor_parallel": {"autotp_size": 2}},
}
PAIRS = (("ulysses", "blockwise"), ("tp", "tp gathered"))


def _llama(hidden: int, layers: int) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=hidden,
        intermediate_size=hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=8192,
        attention_dropout=0.0,
    )
    return LlamaForCausalLM(config)


def _engine(variant: str, hidden: int, layers: int) -> Any:
    """The engine for ``variant``; the two fallbacks are reached by simulating the first route's refusal."""
    import slipstream
    from slipstream.engine.config import ConfigError
    from slipstream.engine.parallel.sequence import options as sequence_options
    from slipstream.engine.parallel.tensor import parallelize as tensor_parallelize
    from slipstream.engine.parallel.tensor import selfcheck

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
        **VARIANTS.get(variant, {}),
    }
    saved_heads, saved_verify = sequence_options._check_heads, selfcheck.verify
    refused = []

    def refuse_heads(*args: Any) -> None:
        raise ConfigError("sequence_parallel_size: simulated: the kernels cannot take this model")

    def refuse_once(*args: Any, **kwargs: Any) -> None:
        if not refused:
            refused.append(True)
            raise ConfigError("tensor_parallel: simulated: the heads do not shard")
        saved_verify(*args, **kwargs)

    if variant == "blockwise":
        sequence_options._check_heads = refuse_heads
    if variant == "tp gathered":
        tensor_parallelize.selfcheck.verify = refuse_once
    model = _llama(hidden, layers)
    if variant.startswith("tp"):
        model.config.base_model_tp_plan = None  # both inferred: the fallback is for inferred plans only
    try:
        return slipstream.initialize(model, config)
    finally:
        sequence_options._check_heads, tensor_parallelize.selfcheck.verify = saved_heads, saved_verify


def _step(engine: Any, tokens: Any) -> tuple[float, int]:
    import torch
    import torch.distributed as dist

    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    if dist.is_initialized():
        dist.barrier()
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = engine(input_ids=tokens, labels=tokens).loss
    engine.backward(loss)
    engine.step()
    return time.perf_counter() - start, saved[0]


def _worker(rank: int, rounds: int, tokens: int, hidden: int, layers: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    setup_rank_env(rank, 2, port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    batch = torch.randint(0, 1024, (1, tokens), generator=torch.Generator().manual_seed(1))
    results: dict[str, Any] = {}
    for pair in PAIRS:
        engines = {name: _engine(name, hidden, layers) for name in pair}
        for engine in engines.values():
            _step(engine, batch)  # warm-up
        times: dict[str, list[float]] = {name: [] for name in pair}
        for _ in range(rounds):
            for name, engine in engines.items():
                seconds, saved = _step(engine, batch)
                times[name].append(seconds)
                results[f"saved {name}"] = saved
        results.update(times)
        for engine in engines.values():
            engine.close()
    dist.destroy_process_group()
    Path(f"{out}.{rank}").write_text(json.dumps(results))


def _one_process(rounds: int, tokens: int, hidden: int, layers: int) -> tuple[float, int]:
    """One process, the whole sequence, the model's own attention: the reference for the saved bytes."""
    import torch

    torch.set_num_threads(1)
    model = _llama(hidden, layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    batch = torch.randint(0, 1024, (1, tokens), generator=torch.Generator().manual_seed(1))
    times, saved = [], 0
    for _ in range(rounds + 1):
        count = [0]

        def pack(t: torch.Tensor, count: list[int] = count) -> torch.Tensor:
            count[0] += t.numel() * t.element_size()
            return t

        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
        saved = count[0]
    return statistics.median(times[1:]), saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    ranks = spawn_ranks(_worker, args.rounds, args.tokens, args.hidden, args.layers)
    one_ms, one_saved = _one_process(args.rounds, args.tokens, args.hidden, args.layers)
    print(
        f"Llama hidden {args.hidden}, {args.layers} layers, 8 heads (4 KV), 1 × {args.tokens} tokens, fp32, AdamW; "
        f"2 gloo ranks, one thread each; medians of {args.rounds} alternating rounds (slowest rank)"
    )
    print(f"one process: {one_ms * 1e3:.1f} ms per step, {one_saved / 2**20:.1f} MiB of activations saved for backward")
    print(f"{'preferred':<12}{'fallback':<13}{'ms':>9}{'ms':>9}{'fallback / preferred':>22}{'saved MiB/rank':>18}")
    for preferred, fallback in PAIRS:
        ms = {
            name: statistics.median(max(r[name][i] for r in ranks) for i in range(args.rounds)) * 1e3
            for name in (preferred, fallback)
        }
        saved = {name: max(r[f"saved {name}"] for r in ranks) / 2**20 for name in (preferred, fallback)}
        print(
            f"{preferred:<12}{fallback:<13}{ms[preferred]:>9.1f}{ms[fallback]:>9.1f}{ms[fallback] / ms[preferred]:>21.2f}×"
            f"{saved[preferred]:>8.1f} → {saved[fallback]:.1f}"
        )


if __name__ == "__main__":
    main()
