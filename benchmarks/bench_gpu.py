"""On GPUs: slipstream ZeRO-0 and ZeRO-3 next to DDP and FSDP2, same model, same data, same GPUs.

    python benchmarks/bench_gpu.py [--gpus N] [--steps 10] [--rounds 2] [--hidden 2048] [--layers 16]

Model: a Llama (``LlamaForCausalLM``) of ``--layers`` layers, hidden ``--hidden``, heads of 128,
MLP 8h/3 (rounded to 256), vocab 32000, seq 2048, micro-batch 2 per GPU, bf16 weights and compute,
AdamW. Configurations: ``slipstream-z0`` (ZeRO stage 0: data parallel), ``slipstream-z3``
(ZeRO-3), ``ddp`` (``DistributedDataParallel``), ``fsdp2`` (``torch.distributed.fsdp.fully_shard``
per decoder layer and the root). Each is a fresh job of ``--gpus`` processes on NCCL;
configurations alternate round by round. Printed per configuration: median step time, tokens/s
over all GPUs, MFU (model FLOPs 6·N + 12·L·h·s per token over the GPUs' dense bf16 peak) and
peak ``torch.cuda.max_memory_allocated`` per GPU. ``scripts/gpu_check.sh`` runs this after the
CUDA test tier; it needs at least one GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
KINDS = ("slipstream-z0", "slipstream-z3", "ddp", "fsdp2")
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}
SEQ, MICRO, VOCAB, WARMUP = 2048, 2, 32000, 3


def _model(hidden: int, layers: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=hidden,
        intermediate_size=(8 * hidden // 3 + 255) // 256 * 256,
        num_attention_heads=hidden // 128,
        num_key_value_heads=hidden // 128,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        attn_implementation="sdpa",
        torch_dtype=torch.bfloat16,
    )
    return LlamaForCausalLM(config).to(torch.bfloat16)


def _worker(kind: str, hidden: int, layers: int, steps: int, out: str) -> None:
    import time

    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    model = _model(hidden, layers)
    params = sum(p.numel() for p in model.parameters())
    if kind.startswith("slipstream"):
        import slipstream

        stage = 0 if kind.endswith("z0") else 3
        engine = slipstream.initialize(
            model,
            {
                "train_micro_batch_size_per_gpu": MICRO,
                "gradient_clipping": 1.0,
                "bf16": {"enabled": True},
                "zero_optimization": {"stage": stage},
                "steps_per_print": 10**9,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            },
        )

        def step(tokens: torch.Tensor) -> None:
            loss = engine(input_ids=tokens, labels=tokens).loss
            engine.backward(loss)
            engine.step()
    else:
        dist.init_process_group("nccl")
        from benchmarks.common import lm_step, wrap_peer

        model = model.cuda()
        wrapped = wrap_peer(kind, model, model.model.layers)
        step = lm_step(wrapped, torch.optim.AdamW(wrapped.parameters(), lr=1e-4, fused=True))

    generator = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, VOCAB, (MICRO, SEQ), generator=generator).cuda() for _ in range(WARMUP + steps)]
    times = []
    for k, tokens in enumerate(batches):
        if k == WARMUP:
            torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        step(tokens)
        torch.cuda.synchronize()
        if k >= WARMUP:
            times.append(time.perf_counter() - start)
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**20], device="cuda")
    peaks = [torch.zeros_like(peak) for _ in range(world)]
    dist.all_gather(peaks, peak)
    if rank == 0:
        Path(out).write_text(
            json.dumps(
                {
                    "times": times,
                    "peaks": [float(p) for p in peaks],
                    "params": params,
                    "device": torch.cuda.get_device_name(),
                }
            )
        )
    dist.barrier()
    dist.destroy_process_group()


def _run(kind: str, gpus: int, hidden: int, layers: int, steps: int) -> dict | str:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={gpus}",
            __file__,
            "--worker",
            kind,
            "--hidden",
            str(hidden),
            "--layers",
            str(layers),
            "--steps",
            str(steps),
            "--out",
            out.name,
        ]
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)  # keep the caller's path
        env = {**os.environ, "PYTHONPATH": path, "SLIPSTREAM_ACCELERATOR": "cuda"}
        done = subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode != 0:
            return _failure(done.stderr, done.returncode)
        return json.loads(Path(out.name).read_text())


def _failure(stderr: str, code: int) -> str:
    """The worker's own error line (torchrun's summary banner ends stderr, so its last line says nothing)."""
    lines = [line.strip() for line in stderr.splitlines()]
    errors = [line for line in lines if re.match(r"^[\w.]*(Error|Exception)\b", line)]
    return errors[-1] if errors else f"exit {code}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker, args.hidden, args.layers, args.steps, args.out)
        return
    results: dict[str, dict] = {k: {"times": [], "peaks": [], "error": None} for k in KINDS}
    info: dict = {}
    for _ in range(args.rounds):
        for kind in KINDS:
            data = _run(kind, args.gpus, args.hidden, args.layers, args.steps)
            if isinstance(data, str):
                results[kind]["error"] = data
                continue
            results[kind]["times"] += data["times"]
            results[kind]["peaks"] = [max(a, b) for a, b in zip(results[kind]["peaks"], data["peaks"])] or data["peaks"]
            info = data
    if not info:
        print("bench_gpu: every configuration failed:", {k: r["error"] for k, r in results.items()})
        sys.exit(1)
    tokens = MICRO * SEQ * args.gpus
    flops_per_token = 6 * info["params"] + 12 * args.layers * args.hidden * SEQ
    peak = next((v for key, v in PEAK_BF16_TFLOPS.items() if key in info["device"]), None)
    print(
        f"{info['device']} x {args.gpus}; Llama h {args.hidden}, {args.layers} layers ({info['params'] / 1e6:.0f}M parameters), "
        f"seq {SEQ}, micro-batch {MICRO}/GPU, bf16; {args.rounds} alternating rounds x {args.steps} steps"
    )
    print(f"{'config':<15} {'median ms':>9} {'tokens/s':>10} {'MFU':>6} {'peak alloc/GPU MB':>18} {'vs ddp':>7}")
    base = statistics.median(results["ddp"]["times"]) if results["ddp"]["times"] else None
    for kind in KINDS:
        r = results[kind]
        if not r["times"]:
            print(f"{kind:<15} failed: {r['error']}")
            continue
        median = statistics.median(r["times"])
        mfu = f"{flops_per_token * tokens / median / (peak * 1e12 * args.gpus):.3f}" if peak else "-"
        vs = f"{median / base:.3f}x" if base else ""
        print(f"{kind:<15} {median * 1e3:9.1f} {tokens / median:10.0f} {mfu:>6} {max(r['peaks']):18.0f} {vs:>7}")


if __name__ == "__main__":
    main()
