"""The longest sequence that trains within a peak-RSS cap per rank: plain vs tiled logits vs tiled MLP vs both.

    python benchmarks/bench_long_context.py [--cap-mb 1200] [--variants plain,logits,mlp,both] [--start 2048] [--stop N]
    python benchmarks/bench_long_context.py --curve 2048,4096,8192 [--variants plain,both] [--plot peak.svg]

Model: a Llama from a config whose vocabulary is large beside its width, as real ones are (32,000
tokens, hidden 256, intermediate 1024, 2 layers, 4 heads, 2 KV heads: 9.5M parameters of which
8.2M in the embedding and head), fp32, AdamW, one row of ``seq`` tokens, Ulysses
(``sequence_parallel_size`` 2) on 2 ranks (gloo, one thread each), ZeRO ``--stage`` (default 0).
Variants: ``plain``, ``logits`` (tiled logits), ``mlp`` (tiled MLP), ``both``, and ``all`` (both, and
the checkpointed inputs in files: ``activation_checkpointing.offload_path``); ``--layers`` sets the
depth (the checkpointed inputs grow with it). Each job is a fresh pair of processes running two full steps; its peak RSS per rank
(``ru_maxrss``, the larger rank's) is the high-water mark of the whole job, RSS after
``initialize`` is reported beside it.

Search: per variant, the sequence doubles from ``--start`` while the peak stays under the cap,
then bisects (to a multiple of 256 tokens) between the last fit and the first miss. ``--curve``
measures the listed lengths instead (peak against length) for each variant, in alternating order
(A B A B) so a drifting machine affects all variants alike; ``--plot`` draws them (SVG) beside the
estimator's prediction: the job's RSS after ``initialize`` plus the gradients and AdamW's states
(12 bytes per parameter in fp32) plus ``slipstream.estimator.activation_bytes`` for the variant plus
the same-host collectives' ring (``host_collective_bytes``: its shared file is touched by the first
step's gradient all-reduce, after ``initialize``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.common import current_rss_mb, peak_rss_mb, setup_rank_env, spawn_ranks  # noqa: E402

VOCAB = 32000
TILE = 512
VARIANTS = {
    "plain": {},
    "logits": {"tiled_logits": {"enabled": True, "tile_tokens": TILE}},
    "mlp": {"tiled_mlp": {"enabled": True, "tile_tokens": TILE}},
    "both": {
        "tiled_logits": {"enabled": True, "tile_tokens": TILE},
        "tiled_mlp": {"enabled": True, "tile_tokens": TILE},
    },
}
# "all": both tilings, and the checkpointed inputs in files (activation_checkpointing.offload_path)
VARIANTS["all"] = VARIANTS["both"]
OFFLOADED = {"all"}


def _worker(rank: int, variant: str, seq: int, stage: int, layers: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    setup_rank_env(rank, 2, port)
    torch.set_num_threads(1)
    from transformers import LlamaConfig, LlamaForCausalLM

    import slipstream

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=256,
            intermediate_size=1024,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=seq,
            attn_implementation="sdpa",
        )
    )
    engine = slipstream.initialize(
        model,
        {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_clipping": 1.0,
            "steps_per_print": 10**9,
            "twin_check": False,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "sequence_parallel_size": 2,
            "zero_optimization": {"stage": stage},
            "long_context": VARIANTS[variant],
            # every variant checkpoints its blocks, as long-context training does: what is left is the head and the MLPs
            "activation_checkpointing": {
                "module_classes": ["LlamaDecoderLayer"],
                "offload_path": str(Path(out).parent / "activations") if variant in OFFLOADED else None,
            },
        },
    )
    after_init = current_rss_mb()
    ids = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(1))
    times = []
    for _ in range(2):
        start = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - start)
    peaks = [None, None]
    dist.all_gather_object(peaks, (peak_rss_mb(), after_init))
    engine.destroy()
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        Path(f"{out}.{rank}").write_text(
            json.dumps(
                {
                    "peak": max(p for p, _ in peaks),
                    "init": max(i for _, i in peaks),
                    "step": times[-1],
                    "loss": float(loss.detach()),
                    "params": params,
                    "layers": layers,
                    "stage": stage,
                }
            )
        )


def measure(variant: str, seq: int, stage: int, layers: int = 2) -> dict:
    for attempt in range(2):  # a job whose rank dies (a port taken between choosing and binding it) runs once more
        try:
            found = spawn_ranks(_worker, variant, seq, stage, layers)
        except Exception as err:  # noqa: BLE001 - the job's own failure, reported and retried once
            print(
                f"  {variant} at {seq} tokens: job failed ({type(err).__name__}: {err}); attempt {attempt + 1} of 2",
                flush=True,
            )
            found = []
        if found:
            break
    else:
        raise RuntimeError(f"{variant} at {seq} tokens wrote no result")
    result = found[0]
    print(
        f"  {variant:<7} {seq:>7} tokens: peak {result['peak']:7.0f} MB (after initialize {result['init']:5.0f}), second step {result['step']:6.2f} s",
        flush=True,
    )
    return result


def longest(variant: str, cap: float, start: int, stage: int, layers: int, stop: int = 0) -> tuple[int, int]:
    """(longest fitting length, first length found not to fit) under ``cap`` MB; doubling no further than ``stop``
    (when set): a variant that fits there is reported as fitting at least that (first miss 0, not measured)."""
    fit, miss = 0, 0
    seq = start
    while miss == 0:
        if stop and seq > stop:
            return fit, 0
        if measure(variant, seq, stage, layers)["peak"] <= cap:
            fit, seq = seq, seq * 2
        else:
            miss = seq
    if fit == 0:
        return 0, miss
    while miss - fit > 256 * max(1, fit // 4096):
        mid = (fit + miss) // 2 // 256 * 256
        if measure(variant, mid, stage, layers)["peak"] <= cap:
            fit = mid
        else:
            miss = mid
    return fit, miss


def predicted(row: dict, variant: str, seq: int) -> float:
    """The estimate of a job's peak RSS per rank (MB), see the module docstring."""
    from slipstream.estimator import ModelShape, Tiling, activation_bytes, host_collective_bytes

    shape = ModelShape(row["params"], layers=row.get("layers", 2), hidden=256, heads=4, vocab=VOCAB, intermediate=1024)
    section = VARIANTS[variant]
    tiling = Tiling(
        section["tiled_logits"]["tile_tokens"] if "tiled_logits" in section else None,
        section["tiled_mlp"]["tile_tokens"] if "tiled_mlp" in section else None,
        seq_shards=2,
        offload_checkpoints=variant in OFFLOADED,
    )
    acts = activation_bytes(shape, seq, 1, "fp32", checkpointing=True, flash=True, tiling=tiling) or 0.0
    rings = host_collective_bytes(row.get("stage", 0), 2)  # touched by the first step, not yet after initialize
    return row["init"] + (12 * row["params"] + acts + rings) / 2**20


def plot(rows: dict, variants: list[str], lengths: list[int], path: str, stage: int, layers: int) -> None:
    from benchmarks.svg_plot import COLORS, Series, line_plot

    series = []
    for color, v in zip(COLORS, variants):
        series.append(Series(f"{v} measured", lengths, [rows[(v, n)]["peak"] for n in lengths], color))
        series.append(
            Series(f"{v} estimated", lengths, [predicted(rows[(v, n)], v, n) for n in lengths], color, dashed=True)
        )
    line_plot(
        series,
        path,
        f"Peak RSS per rank, Ulysses 2 on 2 ranks, ZeRO {stage}, fp32, {layers} checkpointed layers",
        "sequence length (tokens)",
        "MB per rank",
    )
    print(f"plot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cap-mb", type=float, default=1200.0)
    parser.add_argument("--variants", default="plain,logits,mlp,both")
    parser.add_argument("--start", type=int, default=2048)
    parser.add_argument("--stage", type=int, default=0)
    parser.add_argument(
        "--layers", type=int, default=2, help="decoder layers (more: more checkpointed inputs per token)"
    )
    parser.add_argument(
        "--stop", type=int, default=0, help="search: double no further than this many tokens (reported as >= it)"
    )
    parser.add_argument("--curve", default="", help="comma-separated lengths: measure these instead of searching")
    parser.add_argument(
        "--plot",
        default="",
        help="with --curve: peak RSS against length beside the estimate, as SVG (a .png path: SVG and PNG)",
    )
    args = parser.parse_args()
    variants = args.variants.split(",")
    if args.curve:
        lengths = [int(x) for x in args.curve.split(",")]
        rows = {(v, n): measure(v, n, args.stage, args.layers) for n in lengths for v in variants}
        print(f"\npeak RSS per rank (MB) against sequence length, Ulysses 2, ZeRO {args.stage}")
        print(f"{'tokens':>8}" + "".join(f"{v:>10}" for v in variants))
        for n in lengths:
            print(f"{n:>8}" + "".join(f"{rows[(v, n)]['peak']:>10.0f}" for v in variants))
        print("estimated (MB): RSS after initialize + gradients and AdamW states + the estimator's activations")
        print(f"{'tokens':>8}" + "".join(f"{v:>10}" for v in variants))
        for n in lengths:
            print(f"{n:>8}" + "".join(f"{predicted(rows[(v, n)], v, n):>10.0f}" for v in variants))
        if args.plot:
            plot(rows, variants, lengths, args.plot, args.stage, args.layers)
        return
    found = {}
    for variant in variants:
        print(f"{variant}: searching under {args.cap_mb:.0f} MB per rank", flush=True)
        found[variant] = longest(variant, args.cap_mb, args.start, args.stage, args.layers, args.stop)
    against = "plain" if "plain" in found else variants[0]  # the ratio's base: untiled, else the first variant
    base = found[against][0]
    print(
        f"\nlongest sequence under {args.cap_mb:.0f} MB peak RSS per rank (Ulysses 2 on 2 ranks, ZeRO {args.stage}, {args.layers} layers, tiles of {TILE} tokens)"
    )
    print(f"{'variant':<10}{'fits':>10}{'first miss':>12}{'vs ' + against:>10}")
    for variant, (fit, miss) in found.items():
        at_least = "" if miss else ">="  # fitted at --stop: the search went no further
        ratio = f"{at_least}{fit / base:.2f}x" if base else ""
        print(f"{variant:<10}{at_least + str(fit):>10}{miss or 'not run':>12}{ratio:>10}")


if __name__ == "__main__":
    main()
