"""ZeRO++ (hpZ, qwZ, qgZ) and MiCS on 4 ranks simulated as 2 nodes × 2: inter-node bytes and step time vs ZeRO-3.

    python benchmarks/bench_zeropp.py [--model gpt2-small] [--steps 10] [--rounds 2] [--deepspeed-python /path/to/venv/bin/python]

Every configuration runs as a fresh 4-rank job (gloo, one thread per rank) with ``LOCAL_WORLD_SIZE=2``,
so ranks {0,1} and {2,3} count as two nodes; configurations alternate round by round (A B C ... A B C
...). Bytes per step on each link class come from slipstream's comms log (``comms_log.bytes_by_link``:
a collective's bytes count as inter-node when its group spans nodes; docs/zero.md, "ZeRO++ and MiCS").
On one machine every link is the same memory bus, so the step times show the cost of the extra
work (quantizing, the secondary copy, the cross-replica sum), not the time a slow network would save.

DeepSpeed 0.19.8 runs the same JSON configs under --deepspeed-python when given; a configuration it
cannot run on CPU is reported with its error instead of a time. After training, the per-block
quantization error of the weights (INT8) and of one step's reduced gradients (INT4) is reported:
relative RMS error over all elements, and the worst block's largest error over the block's largest
magnitude (at most half a step: 1/254 at INT8, 1/14 at INT4).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
WORLD, PER_NODE, WARMUP = 4, 2, 3
LAYOUTS = {
    "zero3": {},
    "hpz": {"zero_hpz_partition_size": PER_NODE},
    "mics": {"mics_shard_size": PER_NODE},
    "qwz+qgz": {"zero_quantized_weights": True, "zero_quantized_gradients": True},
    "qwz+hpz+qgz": {
        "zero_hpz_partition_size": PER_NODE,
        "zero_quantized_weights": True,
        "zero_quantized_gradients": True,
    },
}


def _config(layout: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **LAYOUTS[layout]},
    }


def _quantization_error(engine: object, batch: object) -> dict:
    """Per-block error of the weights (INT8) and of one step's reduced gradients (INT4), as the wire would carry them."""
    import torch

    from slipstream.comm.quantized import BLOCK, dequantize, quantize

    def error(values: torch.Tensor, bits: int) -> tuple[float, float]:
        x = values.detach().float().reshape(-1)
        y = dequantize(quantize(x, bits), x.numel(), bits)
        blocks = -(-x.numel() // BLOCK)
        pad = blocks * BLOCK - x.numel()
        top = torch.nn.functional.pad(x.abs(), (0, pad)).view(blocks, BLOCK).amax(dim=1).clamp_min(1e-30)
        worst = torch.nn.functional.pad((x - y).abs(), (0, pad)).view(blocks, BLOCK).amax(dim=1) / top
        return float((x - y).norm() / x.norm().clamp_min(1e-30)), float(worst.max())

    strategy = engine.strategy  # type: ignore[attr-defined]
    weights = torch.cat([u.shard.reshape(-1) for u in strategy.units])
    loss = engine(input_ids=batch, labels=batch).loss  # type: ignore[operator]
    engine.backward(loss)  # type: ignore[attr-defined]
    grads = torch.cat([c.reshape(-1) for c in strategy.reducer.chunks.values()])
    engine.step()  # type: ignore[attr-defined]
    (w_rms, w_worst), (g_rms, g_worst) = error(weights, 8), error(grads, 4)
    return {"weights_rms": w_rms, "weights_worst_block": w_worst, "grads_rms": g_rms, "grads_worst_block": g_worst}


def _worker(rank: int, kind: str, args: argparse.Namespace, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from benchmarks.common import build_gpt2, random_batches, setup_rank_env, time_steps

    setup_rank_env(rank, WORLD, port)
    os.environ["LOCAL_WORLD_SIZE"] = str(PER_NODE)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    framework, layout = kind.split("-", 1)
    model = build_gpt2(args.model)
    batches = random_batches(WARMUP + args.steps + 1, seed=rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
    result: dict = {}
    try:
        if framework == "slipstream":
            import slipstream
            from slipstream.comm import comms_log

            engine = slipstream.initialize(model, _config(layout), optimizer=optimizer)
            comms_log.keep_history = 1
        else:
            import deepspeed

            config = {**_config(layout), "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
            engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

        def step(batch: torch.Tensor) -> None:
            loss = engine(input_ids=batch, labels=batch).loss
            engine.backward(loss)
            engine.step()

        result["times"] = time_steps(step, batches[: WARMUP + args.steps], WARMUP)
        if framework == "slipstream":
            result["links"] = dict(comms_log.bytes_by_link(comms_log.history[-1]))
            result["quantization"] = _quantization_error(engine, batches[-1])
    except Exception as err:  # noqa: BLE001 - a peer that cannot run a configuration is reported, not fatal
        result["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"
    if rank == 0:
        Path(f"{out}.0").write_text(json.dumps(result))
    if "error" not in result:
        dist.destroy_process_group()
    else:
        os._exit(0)  # a failed peer may leave collectives hanging: do not wait for them


def run_worker(kind: str, args: argparse.Namespace) -> None:
    from benchmarks.common import spawn_ranks

    found = spawn_ranks(_worker, kind, args, world=WORLD)
    Path(args.out).write_text(json.dumps(found[0] if found else {"error": "no result"}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2-small")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--deepspeed-python", default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker(args.worker, args)
        return
    layouts = args.layouts.split(",")
    kinds = [f"slipstream-{layout}" for layout in layouts]
    if args.deepspeed_python:
        kinds += [f"deepspeed-{layout}" for layout in layouts]
    results: dict[str, dict] = {k: {"rounds": [], "times": []} for k in kinds}
    for _ in range(args.rounds):
        for kind in kinds:
            python = args.deepspeed_python if kind.startswith("deepspeed") else sys.executable
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
                ]
                env = {**os.environ, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu", "THP_MEM_ALLOC_ENABLE": "1"}
                subprocess.run(
                    command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=900
                )
                data = json.loads(Path(out.name).read_text() or "{}")
            entry = results[kind]
            if "error" in data or "times" not in data:
                entry["error"] = data.get("error", "no result")
                continue
            entry["times"] += data["times"]
            entry["rounds"].append(statistics.median(data["times"]))
            entry.update({k: data[k] for k in ("links", "quantization") if k in data})

    print(
        f"{args.model}, {WORLD} ranks as 2 nodes x {PER_NODE} (gloo, 1 thread each), fp32, AdamW(fused=True), clip 1.0, "
        f"micro-batch 4; {args.rounds} alternating rounds x {args.steps} steps"
    )
    base = results.get("slipstream-zero3", {})
    base_inter = base.get("links", {}).get("inter-node")
    print(
        f"{'config':<24} {'median ms':>9} {'vs ZeRO-3':>9} {'vs DeepSpeed':>12} {'inter-node MB':>13} {'vs ZeRO-3':>9} {'intra-node MB':>13}"
    )
    for kind in kinds:
        entry = results[kind]
        if "error" in entry and not entry["times"]:
            print(f"{kind:<24} could not run: {entry['error']}")
            continue
        median = statistics.median(entry["times"]) * 1e3
        framework = kind.split("-", 1)[0]
        ref = results.get(f"{framework}-zero3", {})
        paired = [a / b for a, b in zip(entry["rounds"], ref.get("rounds", []))]
        vs_zero3 = f"{statistics.median(paired):.3f}x" if paired else "-"
        peer = results.get(kind.replace("slipstream", "deepspeed"), {})
        vs_ds = (
            f"{median / (statistics.median(peer['times']) * 1e3):.3f}x"
            if kind.startswith("slipstream") and peer.get("times")
            else "-"
        )
        links = entry.get("links", {})
        inter, intra = links.get("inter-node", 0), links.get("intra-node", 0)
        ratio = f"{inter / base_inter:.3f}x" if links and base_inter else "-"
        mb = (lambda n: f"{n / 2**20:.2f}") if links else (lambda n: "-")
        print(f"{kind:<24} {median:9.1f} {vs_zero3:>9} {vs_ds:>12} {mb(inter):>13} {ratio:>9} {mb(intra):>13}")
    print(
        "per-block quantization error (relative RMS over all elements; worst block's largest error / its largest magnitude):"
    )
    for kind in kinds:
        q = results[kind].get("quantization")
        if q and kind.startswith("slipstream") and ("qwz" in kind or "qgz" in kind):
            print(
                f"  {kind:<24} weights INT8 {q['weights_rms']:.2e} (worst block {q['weights_worst_block']:.2e}); "
                f"gradients INT4 {q['grads_rms']:.2e} (worst block {q['grads_worst_block']:.2e})"
            )


if __name__ == "__main__":
    main()
