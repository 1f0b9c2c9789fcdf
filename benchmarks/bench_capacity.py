"""Capacity: the largest GPT-style model that trains 3 steps on this machine, per configuration.

    python benchmarks/bench_capacity.py --config zero3+nvme --layers 30,45,59 [--cap-gb 10] [--nvme-path /tmp]

Model: ``GPT2LMHeadModel(GPT2Config(n_embd=2048, n_head=32, vocab_size=32000, n_positions=128,
n_layer=L))`` (≈ 65.8M + L × 50.35M parameters), micro-batch 1, seq 128, fp32, 2 ranks (gloo, one
thread each), AdamW, default settings otherwise. Configs: ``ddp`` (torch DDP + AdamW foreach),
``zero3`` (slipstream ZeRO-3, model built under ``slipstream.zero.Init``), ``zero3+cpu`` (+ optimizer
and parameter offload to CPU), ``zero3+nvme`` (+ both to NVMe under --nvme-path).

Each rank runs under ``RLIMIT_DATA = --cap-gb`` GiB (so a too-large model fails with an allocation
error instead of waking the OOM killer on a shared machine), with ``MALLOC_ARENA_MAX=2`` so glibc's
per-thread arena reservations do not count against it. Layer counts are tried in the order given
and the search stops at the first failure. Prints one line per attempt: parameters, whether 3
steps finished, the losses, median step time and peak RSS per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _build(layers: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_embd=2048,
        n_head=32,
        vocab_size=32000,
        n_positions=128,
        n_layer=layers,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(config)


def _worker(rank: int, port: int, kind: str, layers: int, cap: int, nvme: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from benchmarks.common import peak_rss_mb, setup_rank_env

    resource.setrlimit(resource.RLIMIT_DATA, (cap, resource.getrlimit(resource.RLIMIT_DATA)[1]))
    setup_rank_env(rank, 2, port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    result: dict = {"rank": rank}
    try:
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
            "zero_optimization": {"stage": 3},
        }
        if kind == "zero3+cpu":
            config["zero_optimization"].update(offload_optimizer={"device": "cpu"}, offload_param={"device": "cpu"})
        if kind == "zero3+nvme":
            config["zero_optimization"].update(
                offload_optimizer={"device": "nvme", "nvme_path": nvme},
                offload_param={"device": "nvme", "nvme_path": nvme},
            )
        start = time.perf_counter()
        if kind == "ddp":
            model = _build(layers)
            wrapped = torch.nn.parallel.DistributedDataParallel(model)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, foreach=True)

            def step(batch: torch.Tensor) -> float:
                loss = wrapped(input_ids=batch, labels=batch).loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                return float(loss)
        else:
            import slipstream

            with slipstream.zero.Init(config=config):
                model = _build(layers)
            engine = slipstream.initialize(model, config)

            def step(batch: torch.Tensor) -> float:
                loss = engine(input_ids=batch, labels=batch).loss
                engine.backward(loss)
                engine.step()
                return float(loss)

        result["params"] = sum(p.numel() for p in model.parameters())
        result["init_s"] = time.perf_counter() - start
        result["peak_after_init_mb"] = peak_rss_mb()
        generator = torch.Generator().manual_seed(rank)
        losses, times = [], []
        for _ in range(3):
            batch = torch.randint(0, 32000, (1, 128), generator=generator)
            t = time.perf_counter()
            losses.append(step(batch))
            times.append(time.perf_counter() - t)
            result.setdefault("peak_per_step_mb", []).append(peak_rss_mb())
        result.update(ok=True, losses=losses, times=times)
    except (RuntimeError, MemoryError, OSError) as err:  # allocation failure under the cap
        result.update(ok=False, error=str(err).splitlines()[0][:200])
    result["peak_rss_mb"] = peak_rss_mb()
    Path(f"{out}.{rank}").write_text(json.dumps(result))
    os._exit(0)  # a failed rank may leave the other in a collective: do not wait for teardown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="zero3", choices=["ddp", "zero3", "zero3+cpu", "zero3+nvme"])
    parser.add_argument("--layers", default="19")
    parser.add_argument("--cap-gb", type=float, default=10.0, help="RLIMIT_DATA per rank, GiB")
    parser.add_argument("--nvme-path", default="/tmp")
    parser.add_argument("--timeout", type=int, default=3600)
    parser.add_argument("--worker", nargs=5, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        import torch.multiprocessing as mp

        from benchmarks.common import free_port

        kind, layers, cap, nvme, out = args.worker
        mp.spawn(_worker, args=(free_port(), kind, int(layers), int(cap), nvme, out), nprocs=2, join=True)
        return
    cap = int(args.cap_gb * 2**30)
    print(
        f"{args.config}: n_embd 2048, vocab 32000, seq 128, micro-batch 1, fp32, 2 ranks, RLIMIT_DATA {args.cap_gb} GiB/rank"
    )
    for layers in map(int, args.layers.split(",")):
        swap = tempfile.mkdtemp(prefix="bench-capacity-", dir=args.nvme_path)
        out = tempfile.mktemp(prefix="capacity-")
        env = {**os.environ, "PYTHONPATH": str(ROOT), "MALLOC_ARENA_MAX": "2", "THP_MEM_ALLOC_ENABLE": "1"}
        start = time.perf_counter()
        try:
            done = subprocess.run(
                [sys.executable, __file__, "--worker", args.config, str(layers), str(cap), swap, out],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=args.timeout,
                check=False,
            )
            results = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2) if Path(f"{out}.{r}").exists()]
        except subprocess.TimeoutExpired:
            done, results = None, []
        finally:
            shutil.rmtree(swap, ignore_errors=True)
            for r in range(2):
                Path(f"{out}.{r}").unlink(missing_ok=True)
        wall = time.perf_counter() - start
        ok = len(results) == 2 and all(r.get("ok") for r in results)
        params = next((r["params"] for r in results if "params" in r), 65_800_000 + layers * 50_350_000)
        rss = "/".join(f"{r['peak_rss_mb']:.0f}" for r in results)
        if ok:
            steps = sorted(t for r in results for t in r["times"])
            print(
                f"L={layers:3d} {params / 1e9:6.3f}B params: trained 3 steps; losses {results[0]['losses']}; "
                f"init {results[0]['init_s']:.0f} s (peak {results[0]['peak_after_init_mb']:.0f} MB, then {results[0]['peak_per_step_mb']}), median step {steps[len(steps) // 2]:.1f} s; peak RSS/rank {rss} MB; wall {wall:.0f} s"
            )
        else:
            why = next((r["error"] for r in results if not r.get("ok")), None) or (
                "timeout" if done is None else (done.stderr.strip().splitlines() or ["killed"])[-1][:200]
            )
            print(
                f"L={layers:3d} {params / 1e9:6.3f}B params: FAILED ({why}); peak RSS/rank {rss} MB; wall {wall:.0f} s"
            )
            break


if __name__ == "__main__":
    main()
