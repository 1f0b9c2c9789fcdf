"""The sequence and context parallel twins: Ulysses, ring and zig-zag against the model's own attention.

For sequence and context parallelism the twin is the same model with its own attention on the whole
sequence: every rank of the group holds the whole model, so each runs the reference itself, then the
engine's sharded forward and backward, and compares (a) every module's output on its own tokens, in
call order, (b) the whole-sequence loss, (c) the group-mean gradients. A kernel that refuses a
feature raises on the first forward: the same check turns that into the refusal at ``initialize``.
``check_sequence_pipeline_twin`` does the same for a pipeline stage's blocks under a sequence mode.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from slipstream import comm
from slipstream.engine.config import ConfigError
from slipstream.engine.parallel.tiling.logits import DeferredLogits
from slipstream.engine.parallel.twin.harness import (
    TwinMismatch,
    agree,
    first_gradient_mismatch,
    loss_mismatch,
    quiet_model,
    relative_difference,
    synthetic_tokens,
    tolerance_for,
)


class _Recorder:
    """Each module's first tensor output, in call order (forward hooks on every module)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.outputs: list[tuple[str, torch.Tensor]] = []
        self.handles = [m.register_forward_hook(self._hook(name)) for name, m in model.named_modules() if name]

    def _hook(self, name: str) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            tensor = (
                output[0]
                if isinstance(output, (tuple, list)) and output
                else getattr(output, "last_hidden_state", output)
            )
            if isinstance(tensor, DeferredLogits):
                return  # long_context's head: not computed until its tiled loss, which the loss comparison covers
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and tensor.dim() >= 2:
                self.outputs.append((name, tensor.detach().clone()))

        return hook

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def check_sequence_twin(
    model: torch.nn.Module,
    sharder: Any,
    mode: str,
    averaging: Mapping[int, dist.ProcessGroup] | None = None,
    batch: dict[str, Any] | None = None,
    what: str = "a synthetic batch",
) -> None:
    """Sharded forward/backward vs. the same model's own attention on the whole sequence; raises ConfigError naming
    the first divergence. ``batch``: keyword arguments with labels (default: random tokens, ``what`` names it)."""
    if batch is None:
        tokens = synthetic_tokens(model, sharder.divisor).to(next(model.parameters()).device)
        batch = {"input_ids": tokens, "labels": tokens.clone()}
    source = batch.get("input_ids", batch.get("inputs_embeds"))
    length = int(source.shape[1])
    name = type(model).__name__
    tolerance = tolerance_for(model)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    with quiet_model(model), torch.enable_grad():
        recorder = _Recorder(model)
        try:
            reference = model(**batch)
            ref_loss = getattr(reference, "loss", None)
            if ref_loss is None:
                raise ConfigError(
                    f"{sharder.key}: {name} returned no loss for input_ids with labels; sequence sharding needs a model that computes its loss"
                )
            ref_grads = _gradients(ref_loss, trainable)
            ref_outputs, recorder.outputs = recorder.outputs, []
            local, count = sharder.shard(batch)
            sharder.activate()
            try:  # a kernel's UnsupportedAttention (a ConfigError) is the refusal itself
                output = sharder.combine(model(**local), count)
                our_grads = _gradients(output.loss * 1.0, trainable)
            finally:
                sharder.deactivate()
            ours = recorder.outputs
        finally:
            recorder.close()
        gradients = first_gradient_mismatch(
            _group_mean_pairs(model, ref_grads, sharder.group, averaging, our_grads), ref_grads, tolerance
        )
        mismatch = (
            _first_mismatch(ref_outputs, ours, sharder, length, tolerance)
            or loss_mismatch(float(output.loss.detach()), float(ref_loss.detach()), tolerance)
            or gradients
        )
        agree(mismatch, sharder.group, f"{sharder.key}: {mode} does not reproduce {name} on {what} (twin check)")


def _gradients(loss: torch.Tensor, trainable: list[tuple[str, torch.nn.Parameter]]) -> dict[str, torch.Tensor]:
    """The loss's gradients by name, returned rather than accumulated: after ``initialize`` the ZeRO strategy's
    hooks take every gradient that reaches ``.grad`` (the first-batch check runs then), and must see none here."""
    found = torch.autograd.grad(loss, [p for _, p in trainable], allow_unused=True)
    return {n: g for (n, _), g in zip(trainable, found) if g is not None}


def check_sequence_pipeline_twin(
    pipeline: Any,
    sharder: Any,
    mode: str,
    averaging: Mapping[int, dist.ProcessGroup] | None = None,
    batch: dict[str, Any] | None = None,
    what: str = "a synthetic batch",
) -> None:
    """Under a pipeline: one schedule on whole sequences with the model's own attention against one on this
    rank's shards with the sharded attention; the loss, then this stage's group-mean gradients. Every rank
    of the world raises together (the stages' verdicts differ, and none may go on while another stops).
    ``batch``: keyword arguments with labels, run as every micro-batch of the schedule (default: random tokens)."""
    model = pipeline.model
    name, tolerance = type(model).__name__, tolerance_for(model)
    device = next(model.parameters()).device
    if batch is None:
        tokens = [synthetic_tokens(model, sharder.divisor, seed=k).to(device) for k in range(pipeline.micro_batches)]
        batches = [{"input_ids": t, "labels": t.clone()} for t in tokens]
    else:
        batches = [dict(batch) for _ in range(pipeline.micro_batches)]
    scale = 1.0 / len(batches)
    with quiet_model(model):
        for p in model.parameters():
            p.grad = None
        reference = pipeline.train_step(batches, scale, contextlib.nullcontext)
        ref_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}  # taken, not copied
        for p in model.parameters():
            p.grad = None
        local = [sharder.shard(b) for b in batches]
        sharder.activate()
        try:
            ours = pipeline.train_step(
                [b for b, _ in local], scale, contextlib.nullcontext, lambda out, i: sharder.combine(out, local[i][1])
            )
        finally:
            sharder.deactivate()
        gradients = first_gradient_mismatch(
            _group_mean_pairs(model, ref_grads, sharder.group, averaging), ref_grads, tolerance
        )
        mismatch = (
            loss_mismatch(
                sum(ours.losses) / len(ours.losses),
                sum(reference.losses) / len(reference.losses),
                tolerance,
                "the step's loss",
            )
            or gradients
        )
        pipeline.last_report = None
    agree(
        mismatch,
        dist.group.WORLD,
        f"{sharder.key}: {mode} inside the pipeline's stages does not reproduce {name} on {what} (twin check)",
        "the same pipeline with the model's own attention on whole sequences",
    )


def _first_mismatch(
    reference: list[tuple[str, torch.Tensor]],
    ours: list[tuple[str, torch.Tensor]],
    sharder: Any,
    length: int,
    tolerance: float,
) -> TwinMismatch | None:
    """The first module (in call order) whose output on this rank's tokens differs from the reference's (the
    engine's fill beyond ``length``, sequence/inputs.py, left out)."""
    index = sharder.positions(-(-length // sharder.divisor) * sharder.divisor)
    real = index < length
    ref_by_call = {}
    for name, tensor in reference:
        ref_by_call.setdefault(name, []).append(tensor)
    seen: dict[str, int] = {}
    for name, tensor in ours:
        k = seen.get(name, 0)
        seen[name] = k + 1
        candidates = ref_by_call.get(name, [])
        if k >= len(candidates):
            return TwinMismatch(f"module {name!r} (called more often than in the unparallelized model)", float("inf"))
        ref = candidates[k]
        if ref.dim() < 2 or ref.shape[1] != length or tensor.shape[1] != index.numel():
            continue  # not a per-token output (or not on the sequence dimension)
        ref_local = ref.index_select(1, index[real].to(ref.device))
        tensor = tensor[:, real.to(tensor.device)]
        if ref_local.shape != tensor.shape:
            continue
        difference = relative_difference(tensor, ref_local)
        if difference > tolerance:
            return TwinMismatch(f"module {name!r} ({type(tensor).__name__} output)", difference)
    return None


def _group_mean_pairs(
    model: torch.nn.Module,
    reference: dict[str, torch.Tensor],
    group: dist.ProcessGroup,
    averaging: Mapping[int, dist.ProcessGroup] | None = None,
    grads: dict[str, torch.Tensor] | None = None,
) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """The group-mean gradients (one flat all-reduce per group) beside the reference's, parameter by parameter.
    Collective: every rank of ``group`` computes them, whatever it found before (a rank whose module outputs
    already differ still takes part, or its peers' all-reduce meets the verdict's and gloo aborts).

    [Note: which ranks to average] The ranks of ``group`` hold the same parameters and saw different parts of
    the batch, so their mean is the whole batch's gradient. A parameter in ``averaging`` (an expert, by ``id``)
    is another one on each rank of ``group``; its own group (the ranks that hold the same experts, as ZeRO
    averages it) takes its place.
    """
    named = [(n, p) for n, p in model.named_parameters() if n in reference]
    by_group: dict[int, tuple[dist.ProcessGroup, list[tuple[str, torch.nn.Parameter]]]] = {}
    for name, p in named:
        own = (averaging or {}).get(id(p), group)
        by_group.setdefault(id(own), (own, []))[1].append((name, p))
    means: dict[str, torch.Tensor] = {}
    for own, members in by_group.values():  # the same groups in the same order on every rank: one model, one walk
        held = [
            (grads.get(name) if grads is not None else p.grad) for name, p in members
        ]  # ``grads``: by name, else .grad
        flat = torch.cat(
            [
                (g if g is not None else torch.zeros_like(reference[name])).detach().reshape(-1).float()
                for (name, _), g in zip(members, held)
            ]
        )
        comm.all_reduce(flat, group=own, tag="twin check gradients").wait()
        flat /= dist.get_world_size(own)
        offset = 0
        for name, _ in members:
            shape = reference[name].shape
            means[name] = flat[offset : offset + reference[name].numel()].view(shape)
            offset += reference[name].numel()
    for name, _ in named:
        yield name, means[name], reference[name]
