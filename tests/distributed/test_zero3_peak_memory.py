"""ZeRO-3's peak per rank against the model-state formula, beside torch DDP, as plain ``torchrun`` launches it.

The formula (ZeRO paper, fp32 AdamW): DDP holds 16Ψ bytes of model states on every rank (weights,
gradients, two moments; here its gradients are views of its buckets and AdamW is fused), stage 3
16Ψ/N. Beyond its shard, stage 3 holds at its peak (inside the backward of the last blocks, every
activation alive) what its schedule has gathered or has in flight, counted from the units
``find_units`` cuts: the root unit and its gradients (a tied head's embedding is used again in the
backward), the running block and the one gathered ahead, the send buffers of the reduce-scatters
in flight (at most two: the test bounds them with ``reduce_bucket_size``, whose default lets
their number depend on how fast the collectives finish), and one block's gradients as autograd
hands them over. So stage 3's peak is at most DDP's less the formula's 16Ψ(1 - 1/N), plus that
(measured: 0.9 to 1.4 blocks below it); and from 2 to 4 ranks it falls by the formula's 16Ψ/4 (within a fifth).

The peak is the allocators' bytes in use (glibc ``mallinfo2``, every arena: the engine's ring
threads allocate in their own; and the large blocks slipstream maps itself), sampled after every
operator of a step, forward and backward: live bytes, which the heap's slack (freed pages glibc
keeps, different from run to run) cannot blur. Both sides run under the allocator an engine
installs (``ops/large_blocks.py``): DDP measured before any engine in the process ran on glibc
alone, whose rounding of large blocks differs by 2.5 MiB, and whether a pool worker had run an
engine before depended on the order of the tests. Each rank measures a second run: the first pays
what a process allocates once, which a pool worker that ran other tests already holds.
``benchmarks/bench_zero.py`` measures the resident size on the large workload. The ranks run
without ``THP_MEM_ALLOC_ENABLE`` (huge pages), as plain ``torchrun`` does and unlike
``slipstream run``.
"""

from __future__ import annotations

import gc
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import slipstream
from benchmarks.common import lm_step
from benchmarks.memory_probe import malloc_in_use
from slipstream.engine.zero.stage3.units import find_units
from slipstream.ops import large_blocks
from tests.harness import run_distributed
from tests.reference import tiny_gpt2

pytestmark = pytest.mark.skipif(malloc_in_use() == 0, reason="needs glibc's mallinfo2 (glibc 2.33 or later)")

SEQ, BATCH, VOCAB = 32, 2, 512
LAYERS = 16  # the gathered units (root, last block, the one ahead) are small beside 16Ψ/N


class _PeakInUse(TorchDispatchMode):
    """The most malloc bytes in use after any operator inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, malloc_in_use())
        return out


def _peak_body(kind: str) -> dict[str, float]:
    """The second of two runs: the first pays what a process allocates once (gloo's and DDP's lazy state),
    which a pool worker that ran other tests already holds and a fresh one does not."""
    _measure(kind)
    return _measure(kind)


def _measure(kind: str) -> dict[str, float]:
    rank = dist.get_rank()
    torch.manual_seed(rank)
    batches = [torch.randint(0, VOCAB, (BATCH, SEQ)) for _ in range(3)]
    large_blocks.install()  # the allocator an engine runs under, for DDP too (see the module's docstring)
    # Free what the previous run left in reference cycles (an engine and its hooks) now, not inside the
    # window: collected there, it had lowered a peak by ~105 MiB and broken the 2-to-4-rank comparison.
    gc.collect()
    before = malloc_in_use()
    model = tiny_gpt2(seed=0, n_layer=LAYERS, n_embd=256)
    model.resize_token_embeddings(VOCAB)
    psi = sum(p.numel() for p in model.parameters())
    units = find_units(model, None, 0)
    root = sum(u.numel for u in units if u.kind == "root")
    block = max(u.numel for u in units if u.kind == "block")

    def adamw(params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True)  # no per-tensor temporaries

    if kind == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        step = lm_step(wrapped, adamw(wrapped.parameters()))
        close = lambda: None  # noqa: E731
    else:
        zero = {"stage": 3, "reduce_bucket_size": 2 * block}  # two send buffers in flight at most
        config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_clipping": 1.0, "zero_optimization": zero}
        engine = slipstream.initialize(model, config, optimizer=adamw)

        def step(batch: torch.Tensor) -> None:
            engine.backward(engine(input_ids=batch, labels=batch).loss)
            engine.step()

        close = engine.close
    for batch in batches[:2]:  # settled: optimizer state and buffers exist
        step(batch)
    with _PeakInUse() as meter:
        step(batches[2])
    close()
    return {
        "psi": psi,
        "root": root,
        "block": block,
        "peak": meter.peak - before,
        "thp": os.environ.get("THP_MEM_ALLOC_ENABLE", ""),
    }


def test_stage3_peak_is_the_formulas_saving_below_ddp_at_2_and_4_ranks() -> None:
    peaks = {}
    for world in (2, 4):
        ddp = run_distributed(world, _peak_body, "ddp", timeout=300)
        stage3 = run_distributed(world, _peak_body, "stage3", timeout=300)
        psi, root, block = ddp[0]["psi"], ddp[0]["root"], ddp[0]["block"]
        formula = 16 * psi * (1 - 1 / world)
        # root and its gradients, running and prefetched block, two send buffers, one block's gradients (fp32);
        # on this model the bound is 0.835 of the formula at 2 ranks, 0.89 at 4 (issue 54 asks for 0.8)
        held = 4 * (2 * root + 5 * block)
        for rank, (a, b) in enumerate(zip(ddp, stage3)):
            assert a["thp"] in ("", "0"), "run without THP_MEM_ALLOC_ENABLE, as plain torchrun does"
            saving = a["peak"] - b["peak"]
            assert saving >= formula - held, (  # measured 2.4 to 3.9 MiB above the bound (0.9 to 1.4 blocks)
                f"{world} ranks, rank {rank}: stage 3 peaks {saving / 2**20:.1f} MiB below DDP ({b['peak'] / 2**20:.1f} vs "
                f"{a['peak'] / 2**20:.1f} MiB); the formula saves {formula / 2**20:.1f} MiB, less the "
                f"{held / 2**20:.1f} MiB its schedule holds"
            )
        peaks[world] = max(b["peak"] for b in stage3)
    fall, expected = peaks[2] - peaks[4], 16 * psi * (1 / 2 - 1 / 4)
    assert abs(fall - expected) <= 0.2 * expected, (
        f"from 2 to 4 ranks the peak fell {fall / 2**20:.1f} MiB, the formula {expected / 2**20:.1f}"
    )
