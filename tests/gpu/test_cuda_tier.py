"""The CUDA tier: what only a GPU can show. ``scripts/gpu_check.sh`` runs it (``-m cuda``) on a GPU machine.

On a machine without one every test here skips with "needs a GPU" (and gpu_check.sh's dry mode
lists them), so the tier is collected, imported and kept compiling in every CI run.

* fused Adam (our CUDA kernel) against ``torch.optim.AdamW(fused=True)``;
* ZeRO 0-3 against plain PyTorch on one GPU, and on every GPU present (NCCL);
* optimizer offload with pinned host memory (the gradient copy on the context's copy stream);
* the communication context's streams are real CUDA streams, distinct from compute.
(Activation checkpointing to CPU memory on CUDA: ``tests/unit/test_activation_checkpointing.py``.)
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from tests.reference import global_batches, tiny_gpt2

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]
LR = 1e-3


@pytest.fixture(autouse=True)
def _cuda_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLIPSTREAM_ACCELERATOR", "cuda")
    from slipstream.accelerator import get_accelerator

    get_accelerator.cache_clear()


def _reference(batches: list[torch.Tensor], pinned: bool = False) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = tiny_gpt2(n_layer=2).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, fused=True)
    losses = []
    for tokens in batches:
        tokens = tokens.cuda()
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses, {n: p.detach().cpu() for n, p in model.named_parameters()}


def _engine_run(
    stage: int,
    batches: list[torch.Tensor],
    rank: int = 0,
    world: int = 1,
    offload: bool = False,
    partition: bool = False,
) -> tuple[list[float], Any]:
    """``partition``: on one GPU, the stage's own partitioning rather than the plain step (single_rank.py)."""
    import torch.distributed as dist

    import slipstream

    zero: dict[str, Any] = {"stage": stage, "partition_single_rank": partition}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    micro = batches[0].shape[0] // world
    engine = slipstream.initialize(
        tiny_gpt2(n_layer=2),
        {
            "train_micro_batch_size_per_gpu": micro,
            "gradient_clipping": 0.0,
            "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        },
    )
    losses = []
    for tokens in batches:
        mine = tokens[rank * micro : (rank + 1) * micro].cuda()
        loss = engine(input_ids=mine, labels=mine).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
        losses.append(float(total) / world)
    return losses, engine


def test_fused_adam_matches_torch_fused_adamw() -> None:
    from slipstream.ops.adam import FusedAdam

    torch.manual_seed(0)
    shapes = [(1000,), (64, 33), (7,), (3, 5, 11)]
    ours = [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    a = FusedAdam(ours, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    b = torch.optim.AdamW(theirs, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, fused=True)
    for step in range(5):
        for p, q in zip(ours, theirs):
            g = torch.randn_like(p) * (step + 1)
            p.grad, q.grad = g, g.clone()
        a.step()
        b.step()
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("partition", [False, True], ids=["plain-step", "partitioned"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stages_match_pytorch_on_one_gpu(stage: int, partition: bool) -> None:
    batches = global_batches(4, 4)
    ref_losses, ref_state = _reference(batches)
    losses, state = _in_process(_one_gpu_body, stage, batches, partition)
    for ours, theirs in zip(losses, ref_losses, strict=True):
        assert abs(ours - theirs) <= 1e-4 * theirs
    for name, value in ref_state.items():
        torch.testing.assert_close(state[name], value, rtol=1e-4, atol=1e-5)


def _in_process(body: Any, *args: Any) -> Any:
    """One rank in this process (the engine joins a world of one on NCCL), left again afterwards."""
    import torch.distributed as dist

    try:
        return body(*args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _one_gpu_body(
    stage: int, batches: list[torch.Tensor], partition: bool
) -> tuple[list[float], dict[str, torch.Tensor]]:
    losses, engine = _engine_run(stage, batches, partition=partition)
    state = {k: v.cpu() for k, v in engine.consolidated_state_dict().items()}
    engine.close()
    return losses, state


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="needs a GPU: at least two")
@pytest.mark.parametrize("stage", [1, 3])
def test_zero_stages_on_every_gpu(stage: int) -> None:
    import torch.multiprocessing as mp

    world = torch.cuda.device_count()
    batches = global_batches(3, 2 * world)
    ref_losses, _ = _reference(batches)
    results = mp.get_context("spawn").Manager().dict()
    mp.spawn(_every_gpu_worker, args=(world, stage, batches, results), nprocs=world)
    for ours, theirs in zip(results[0], ref_losses, strict=True):
        assert abs(ours - theirs) <= 1e-4 * theirs


def _every_gpu_worker(rank: int, world: int, stage: int, batches: list[torch.Tensor], results: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    os.environ["SLIPSTREAM_ACCELERATOR"] = "cuda"
    torch.cuda.set_device(rank)
    losses, engine = _engine_run(stage, batches, rank, world)
    results[rank] = losses
    engine.close()


def test_offload_with_pinned_memory() -> None:
    batches = global_batches(4, 4)
    ref_losses, _ = _reference(batches)
    losses, pinned = _in_process(_offload_body, batches)
    assert pinned, "the offloaded gradients' host buffer is not pinned"
    for ours, theirs in zip(losses, ref_losses, strict=True):
        assert abs(ours - theirs) <= 1e-4 * theirs


def _offload_body(batches: list[torch.Tensor]) -> tuple[list[float], bool]:
    losses, engine = _engine_run(2, batches, offload=True)
    grads = engine.strategy.masters.offload.grads  # the host buffer the device gradients cross into
    pinned = bool(grads is not None and grads.tensors[0].is_pinned())
    engine.close()
    return losses, pinned


def test_communication_context_streams_are_real_and_apart_from_compute() -> None:
    from slipstream.comm.context import KINDS, CommContext

    context = CommContext()
    streams = {kind: context.stream(kind) for kind in KINDS}
    assert all(isinstance(s, torch.cuda.Stream) for s in streams.values())
    assert len({s.cuda_stream for s in streams.values()} | {torch.cuda.current_stream().cuda_stream}) == len(KINDS) + 1
    x = torch.randn(1 << 20, device="cuda")
    y = torch.empty_like(x)

    def launch() -> None:  # a launch returns its async work handle, or None for stream-ordered work
        y.copy_(x * 2)

    pending = context.issue("copy", launch, "test copy")
    context.wait(pending)
    torch.testing.assert_close(y, x * 2)
