"""One Adam step on CPU: slipstream's kernel vs torch AdamW (foreach, fused) vs DeepSpeed CPU Adam.

Two workloads, each for 10M and 100M parameters, flat (one tensor) and split (~200 tensors):

* fp32 step — ``optimizer.step()`` on fp32 params, grads and state (28 bytes per parameter);
* offload step — bf16 grads in, ``grad_scale`` (unscale x clip) applied, fp32 master weights and
  state updated, bf16 params written (also 28 bytes per parameter). Ours is one pass
  (``cpu_adam_step``); torch's is the same work with torch ops around its fused AdamW: grads cast
  to fp32 buffers, fused AdamW with ``grad_scale``, params copied to bf16.

The ceiling for each is measured with the kernel's own access pattern (same loads, stores,
threads and partitioning, trivial arithmetic: ``stream_probe``). Methods alternate within each
repetition and the table reports medians; ratios are what to compare across machines. DeepSpeed
runs in its own interpreter (``--deepspeed-python``) and is timed there against torch's fused
AdamW, so its ratio to ours goes through that shared reference.

    .venv/bin/python benchmarks/bench_adam.py [--sizes 10M,100M] [--deepspeed-python /tmp/dsvenv/bin/python]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

HYPER = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
BYTES_PER_PARAM = 28  # read p, g, m, v and write p, m, v (fp32); offload: 2-byte g in, 2-byte copy out


def parse_size(text: str) -> int:
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1].upper(), 1)
    return int(float(text[:-1] if text[-1].isalpha() else text) * scale)


def tensor_sizes(total: int, count: int, seed: int = 0) -> list[int]:
    """``count`` sizes of varied magnitude (like a model's matrices and vectors) summing to ``total``."""
    if count == 1:
        return [total]
    generator = torch.Generator().manual_seed(seed)
    weights = torch.rand(count, generator=generator) * 1.6 + 0.2
    sizes = (weights / weights.sum() * total).long().tolist()
    sizes = [max(1, s | 1) for s in sizes]  # odd sizes: tails are never a multiple of the vector width
    sizes[0] += total - sum(sizes)
    return sizes


def alternate(methods: dict[str, Callable[[], None]], reps: int, warmup: int = 2) -> dict[str, tuple[float, float]]:
    """(median, min) seconds per call, calling the methods in turn (A B C A B C ...)."""
    times: dict[str, list[float]] = {name: [] for name in methods}
    for rep in range(warmup + reps):
        for name, fn in methods.items():
            start = time.perf_counter()
            fn()
            if rep >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: (statistics.median(ts), min(ts)) for name, ts in times.items()}


def make_params(sizes: list[int]) -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    for p in params:
        p.grad = torch.randn_like(p)
    return params


def fp32_step_methods(sizes: list[int], op) -> dict[str, Callable[[], None]]:
    from slipstream.ops.adam import CPUAdam

    params = make_params(sizes)  # shared: each optimizer keeps its own state
    ours = CPUAdam(params, adamw_mode=True, **HYPER)
    foreach = torch.optim.AdamW(params, foreach=True, **HYPER)
    fused = torch.optim.AdamW(params, fused=True, **HYPER)
    probe_state = ([torch.zeros(n) for n in sizes], [torch.zeros(n) for n in sizes])
    grads = [p.grad for p in params]
    return {
        "slipstream CPUAdam": ours.step,
        "torch AdamW foreach": foreach.step,
        "torch AdamW fused": fused.step,
        "bandwidth (same pattern)": lambda: op.stream_probe(params, grads, *probe_state, [], torch.get_num_threads()),
    }


def offload_step_methods(sizes: list[int], op) -> dict[str, Callable[[], None]]:
    from slipstream.ops.adam import cpu_adam_step

    masters = [torch.randn(n) for n in sizes]
    grads = [torch.randn(n).bfloat16() for n in sizes]
    lowp = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
    scale = 0.5  # unscale x clip coefficient
    ours_state = ([torch.zeros(n) for n in sizes], [torch.zeros(n) for n in sizes])
    torch_state = ([torch.zeros(n) for n in sizes], [torch.zeros(n) for n in sizes])
    grads32 = [torch.empty(n) for n in sizes]  # torch's path needs fp32 grads: preallocated, reused
    steps = [torch.tensor(1.0) for _ in sizes]
    inv_scale = torch.tensor(1 / scale)
    lr, (beta1, beta2), eps, wd = HYPER["lr"], HYPER["betas"], HYPER["eps"], HYPER["weight_decay"]

    def ours() -> None:
        cpu_adam_step(
            masters,
            grads,
            *ours_state,
            step=10,
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            eps=eps,
            weight_decay=wd,
            grad_scale=scale,
            out_lowp=lowp,
        )

    def torch_ops() -> None:
        torch._foreach_copy_(grads32, grads)
        torch._fused_adamw_(
            masters,
            grads32,
            *torch_state,
            [],
            steps,
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            weight_decay=wd,
            eps=eps,
            amsgrad=False,
            maximize=False,
            grad_scale=inv_scale,
        )
        torch._foreach_copy_(lowp, masters)

    probe_state = ([torch.zeros(n) for n in sizes], [torch.zeros(n) for n in sizes])
    return {
        "slipstream cpu_adam_step": ours,
        "torch cast + fused AdamW + copy": torch_ops,
        "bandwidth (same pattern)": lambda: op.stream_probe(
            masters, grads, *probe_state, lowp, torch.get_num_threads()
        ),
    }


DEEPSPEED_SCRIPT = """
import json, statistics, sys, time, torch
from deepspeed.ops.adam import DeepSpeedCPUAdam
torch.set_num_threads(int(sys.argv[3]))
sizes, reps = json.loads(sys.argv[1]), int(sys.argv[2])
params = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
for p in params:
    p.grad = torch.randn_like(p)
hyper = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
methods = {"ds": DeepSpeedCPUAdam(params, adamw_mode=True, **hyper).step,
           "fused": torch.optim.AdamW(params, fused=True, **hyper).step}
times = {k: [] for k in methods}
for rep in range(reps + 2):
    for k, fn in methods.items():
        start = time.perf_counter(); fn(); elapsed = time.perf_counter() - start
        if rep >= 2:
            times[k].append(elapsed)
print(json.dumps({k: statistics.median(v) for k, v in times.items()}))
"""


def deepspeed_times(python: str, sizes: list[int], reps: int, threads: int) -> dict[str, float] | None:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    done = subprocess.run(
        [python, "-c", DEEPSPEED_SCRIPT, json.dumps(sizes), str(reps), str(threads)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    if done.returncode != 0:
        print(f"  DeepSpeed run failed: {done.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10M,100M")
    parser.add_argument("--tensors", default="1,200", help="layouts: number of tensors the parameters are split into")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    default_ds = "/tmp/dsvenv/bin/python" if Path("/tmp/dsvenv/bin/python").exists() else None
    parser.add_argument(
        "--deepspeed-python", default=default_ds, help="interpreter with deepspeed installed ('' to skip)"
    )
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    from slipstream.ops import builder
    from slipstream.ops.specs import CPU_ADAM

    op = builder.load(CPU_ADAM)
    if op is None:
        print(f"CPU Adam op unavailable: {builder.loaded_status(CPU_ADAM)}", file=sys.stderr)
        return 1
    print(
        f"torch {torch.__version__}, {args.threads} threads, kernel isa {op.isa()}, median of {args.reps} alternating reps"
    )
    rows = []
    for size_text in args.sizes.split(","):
        total = parse_size(size_text)
        for count in (int(c) for c in args.tensors.split(",")):
            sizes = tensor_sizes(total, count)
            layout = f"{size_text} {'flat' if count == 1 else f'x{count}'}"
            fp32 = alternate(fp32_step_methods(sizes, op), args.reps)
            gc.collect()  # optimizers hold reference cycles: free one stage's gigabytes before the next
            ds = (
                deepspeed_times(args.deepspeed_python, sizes, args.reps, args.threads)
                if args.deepspeed_python
                else None
            )
            offload = alternate(offload_step_methods(sizes, op), args.reps)
            gc.collect()
            rows.append(report(layout, total, fp32, offload, ds))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


def report(layout: str, total: int, fp32: dict, offload: dict, ds: dict[str, float] | None) -> dict:
    """Print one layout's tables; ratios ("x") are how many times longer the other method took."""

    def line(name: str, times: tuple[float, float], reference: tuple[float, float] | None) -> str:
        median, best = times
        text = f"  {name:<34} {median * 1e3:8.1f} ms (min {best * 1e3:7.1f})  {total / median / 1e6:6.0f} M/s"
        text += f"  {total * BYTES_PER_PARAM / median / 1e9:5.1f} GB/s"
        if reference is not None:
            text += f"  {median / reference[0]:5.2f}x (min {best / reference[1]:4.2f}x)"
        return text

    ours, fused = fp32["slipstream CPUAdam"], fp32["torch AdamW fused"]
    print(f"\n{layout}: fp32 step")
    for name, times in fp32.items():
        print(line(name, times, ours if name.startswith("torch") else None))
    ds_ratio = None
    if ds:
        ds_ratio = (ds["ds"] / ds["fused"]) * (fused[0] / ours[0])  # through torch fused, timed in both processes
        print(
            f"  {'DeepSpeedCPUAdam (own process)':<34} {ds['ds'] * 1e3:8.1f} ms  {total / ds['ds'] / 1e6:25.0f} M/s"
            f"  {ds['ds'] / ds['fused']:.2f}x its torch fused -> {ds_ratio:.2f}x ours"
        )
    bw_fp32 = fp32["bandwidth (same pattern)"][0] / ours[0]
    print(f"  ours at {bw_fp32:.0%} of the bandwidth ceiling (medians)")

    one_pass, torch_ops = offload["slipstream cpu_adam_step"], offload["torch cast + fused AdamW + copy"]
    bw_offload = offload["bandwidth (same pattern)"][0] / one_pass[0]
    print(f"{layout}: offload step (bf16 grads in, scale, fp32 update, bf16 params out)")
    for name, times in offload.items():
        print(line(name, times, one_pass if name.startswith("torch") else None))
    print(f"  ours at {bw_offload:.0%} of the bandwidth ceiling (medians)")
    return {
        "layout": layout,
        "fp32_ms": {k: v[0] * 1e3 for k, v in fp32.items()},
        "offload_ms": {k: v[0] * 1e3 for k, v in offload.items()},
        "deepspeed_ms": {k: v * 1e3 for k, v in ds.items()} if ds else None,
        "fp32_vs_fused": fused[0] / ours[0],
        "fp32_vs_foreach": fp32["torch AdamW foreach"][0] / ours[0],
        "fp32_vs_deepspeed": ds_ratio,
        "fp32_bandwidth_fraction": bw_fp32,
        "offload_vs_torch": torch_ops[0] / one_pass[0],
        "offload_bandwidth_fraction": bw_offload,
    }


if __name__ == "__main__":
    sys.exit(main())
