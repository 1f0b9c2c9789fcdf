"""Ring attention with a sliding window against the same ring without it, at a sequence 4× the window.

    python benchmarks/bench_ring_window.py [--rounds 7] [--tokens 4096] [--heads 8] [--dim 64]

Issue 48's claim: under ring / zig-zag a window shorter than the sequence is where the ring gains, since
the blocks wholly outside the window are skipped ([Note: windows on the ring] in
``parallel/context/ring_attention.py``). Two gloo ranks (one thread each) run the ring kernel itself, forward and
backward, on one sequence of ``tokens`` tokens (batch 1, ``heads`` query heads, ``heads/2`` KV heads,
head dim ``dim``, fp32, causal), contiguous and zig-zag layouts, with a window of ``tokens/4`` (A) and
without one (B), alternating A B A B in the same processes after a warm-up of each. The table gives the
medians, the ratio B / A (above 1: the window is faster) and the block work each rank ran
(``RingAttention.pairs``, in (chunk × chunk) units; a diagonal block counts ½).
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


class _Attention:
    """What the kernel reads of the calling module: causal, as a decoder's attention."""

    is_causal = True
    training = True


def _worker(rank: int, rounds: int, tokens: int, heads: int, dim: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    setup_rank_env(rank, 2, port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from slipstream.engine.parallel.context import Layout, RingAttention

    window = tokens // 4
    g = torch.Generator().manual_seed(0)
    results: dict[str, dict[str, list[float]]] = {}
    for zigzag in (False, True):
        layout = Layout(2, zigzag)
        index = layout.positions(rank, tokens)
        q = torch.randn(1, heads, tokens, dim, generator=g).index_select(2, index)
        k = torch.randn(1, heads // 2, tokens, dim, generator=g).index_select(2, index)
        v = torch.randn(1, heads // 2, tokens, dim, generator=g).index_select(2, index)
        ring = RingAttention(dist.group.WORLD, layout)
        ring.active = True
        name = "zigzag" if zigzag else "ring"

        def run(windowed: bool) -> tuple[float, float]:
            lq, lk, lv = (t.clone().requires_grad_(True) for t in (q, k, v))
            ring.pairs = 0.0
            dist.barrier()
            start = time.perf_counter()
            extra = {"sliding_window": window} if windowed else {}
            out, _ = ring(_Attention(), lq, lk, lv, None, **extra)
            out.sum().backward()
            return time.perf_counter() - start, ring.pairs

        run(True), run(False)  # warm-up
        times: dict[str, list[float]] = {"window": [], "whole": [], "pairs_window": [], "pairs_whole": []}
        for _ in range(rounds):
            for windowed, key in ((True, "window"), (False, "whole")):
                seconds, pairs = run(windowed)
                times[key].append(seconds)
                times[f"pairs_{key}"] = [pairs]
        results[name] = times
    dist.destroy_process_group()
    Path(f"{out}.{rank}").write_text(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    args = parser.parse_args()
    ranks = spawn_ranks(_worker, args.rounds, args.tokens, args.heads, args.dim)
    print(
        f"ring attention forward + backward, 1 × {args.tokens} tokens, {args.heads} heads × {args.dim}, 2 ranks, "
        f"window {args.tokens // 4}; medians of {args.rounds} alternating rounds (slowest rank)"
    )
    print(
        f"{'layout':<8}{'window ms':>11}{'whole ms':>10}{'whole / window':>16}{'block work (window → whole), per rank':>40}"
    )
    for name in ("ring", "zigzag"):
        window = statistics.median(max(r[name]["window"][i] for r in ranks) for i in range(args.rounds)) * 1e3
        whole = statistics.median(max(r[name]["whole"][i] for r in ranks) for i in range(args.rounds)) * 1e3
        work = ", ".join(f"{r[name]['pairs_window'][0]:.2f} → {r[name]['pairs_whole'][0]:.2f}" for r in ranks)
        print(f"{name:<8}{window:>11.1f}{whole:>10.1f}{whole / window:>15.2f}×{work:>40}")


if __name__ == "__main__":
    main()
