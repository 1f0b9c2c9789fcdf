"""ZeRO-3's peak per rank against the model-state formula, beside torch DDP, as plain ``torchrun`` launches it.

The formula (ZeRO paper, fp32 AdamW): DDP holds 16Ψ bytes of model states on every rank (weights,
gradients, two moments; here its gradients are views of its buckets and AdamW is fused), stage 3
16Ψ/N; at the start of backward, when every activation is alive, stage 3 adds the units it has
gathered (the root, the running block). So its peak is at least 80% of 16Ψ(1 - 1/N) below DDP's,
and from 2 to 4 ranks it falls by the formula's 16Ψ/4 (within a fifth): nothing else it holds
grows with the model.

The peak is malloc's bytes in use (glibc ``mallinfo2``, every arena: the engine's ring threads
allocate in their own), sampled after every operator of a step, forward and backward: live bytes,
which the heap's slack (freed pages glibc keeps, different from run to run) cannot blur. Each rank
measures a second run: the first pays what a process allocates once, which a pool worker that ran
other tests already holds. ``benchmarks/bench_zero.py`` measures the resident size on the large
workload. The ranks run without ``THP_MEM_ALLOC_ENABLE`` (huge pages), as plain ``torchrun`` does
and unlike ``slipstream run``.
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
    # Free what the previous run left in reference cycles (an engine and its hooks) now, not inside the
    # window: collected there, it had lowered a peak by ~105 MiB and broken the 2-to-4-rank comparison.
    gc.collect()
    before = malloc_in_use()
    model = tiny_gpt2(seed=0, n_layer=LAYERS, n_embd=256)
    model.resize_token_embeddings(VOCAB)
    psi = sum(p.numel() for p in model.parameters())

    def adamw(params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True)  # no per-tensor temporaries

    if kind == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        step = lm_step(wrapped, adamw(wrapped.parameters()))
        close = lambda: None  # noqa: E731
    else:
        config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_clipping": 1.0, "zero_optimization": {"stage": 3}}
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
    return {"psi": psi, "peak": meter.peak - before, "thp": os.environ.get("THP_MEM_ALLOC_ENABLE", "")}


def test_stage3_peak_is_the_formulas_saving_below_ddp_at_2_and_4_ranks() -> None:
    peaks = {}
    for world in (2, 4):
        ddp = run_distributed(world, _peak_body, "ddp", timeout=300)
        stage3 = run_distributed(world, _peak_body, "stage3", timeout=300)
        psi = ddp[0]["psi"]
        formula = 16 * psi * (1 - 1 / world)
        for rank, (a, b) in enumerate(zip(ddp, stage3)):
            assert a["thp"] in ("", "0"), "run without THP_MEM_ALLOC_ENABLE, as plain torchrun does"
            saving = a["peak"] - b["peak"]
            assert saving >= 0.8 * formula, (  # measured 0.87 at 2 ranks, 0.91 at 4
                f"{world} ranks, rank {rank}: stage 3 peaks {saving / 2**20:.1f} MiB below DDP ({b['peak'] / 2**20:.1f} vs "
                f"{a['peak'] / 2**20:.1f} MiB); the formula saves {formula / 2**20:.1f} MiB"
            )
        peaks[world] = max(b["peak"] for b in stage3)
    fall, expected = peaks[2] - peaks[4], 16 * psi * (1 / 2 - 1 / 4)
    assert abs(fall - expected) <= 0.2 * expected, (
        f"from 2 to 4 ranks the peak fell {fall / 2**20:.1f} MiB, the formula {expected / 2**20:.1f}"
    )
