"""The pipeline's numerical twin check (see the twin package): the cut model's first step against the whole model's.

[Note: what the pipeline twin compares] Before the cut every rank holds the whole model (rank 0's
weights), so each computes the reference itself: the window's ``m`` synthetic micro-batches
through the unchanged model, losses and accumulated gradients. After the cut the same
micro-batches run through the real schedule across the pipeline ranks (P2P, tied-weight sums and
all). The step's losses and every parameter's gradient on this rank must match the reference's.
Whatever the cut cannot see, a block that reads an activation computed between blocks, a block
list run twice, weights shared across more than the two ends, a block the gate skips,
shows up as a loss or gradient that differs, and ``initialize`` refuses, naming the module of
the first parameter that differs. Before the cut, one forward of the whole model with hooks on the blocks refuses
what no cut can carry in words (a block called twice, a block reading an activation computed between blocks). The
synthetic batch is random token ids in the model's first call convention that returns a loss
(``input_ids=/labels=``, ``(tokens, labels)``, ``(tokens)``); a model taking none of them trains
unchecked, and the log says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from slipstream.engine.parallel.calls import call_model
from slipstream.engine.parallel.twin.harness import (
    TwinMismatch,
    agree,
    first_gradient_mismatch,
    loss_mismatch,
    quiet_model,
    tolerance_for,
    whole_model_reference,
)


@dataclasses.dataclass
class Probe:
    """What one forward of the whole model showed (see probe_blocks)."""

    problem: str | None
    order: list[str]  # modules by first call
    inputs: dict[int, tuple[torch.Size, torch.dtype]]  # each block's hidden-state input
    # modules whose first call returned a tensor of its first input's shape and dtype (a norm after the embeddings)
    shape_keeping: frozenset[str] = frozenset()
    skipped: frozenset[int] = (
        frozenset()
    )  # blocks the forward did not call (cut.partition's [Note: blocks the forward skips])
    # the blocks' other activation arguments (a positional index or a keyword), one tensor for every block, carried
    # between stages with the hidden state (cut.StageGate's [Note: activations carried beside the hidden state])
    carried: tuple[int | str, ...] = ()


def probe_blocks(model: torch.nn.Module, blocks: Any, batch: Any) -> Probe:
    """One forward of the whole model: what a cut cannot carry (a block called other than once, in order, or a
    block reading an activation with gradients besides its hidden state; None: nothing found), and the
    qualified names of the modules in the order they first ran (prologue and epilogue by execution, not registration)."""
    calls: list[int] = []
    extras: dict[int, dict[int | str, torch.Tensor]] = {}  # per block: its other activation arguments
    inputs: dict[int, tuple[torch.Size, torch.dtype]] = {}
    order: list[str] = []
    seen: set[str] = set()

    keeping: dict[str, bool] = {}

    def first_call(name: str) -> Any:
        def record(module: torch.nn.Module, args: Any) -> None:
            if name not in seen:
                seen.add(name)
                order.append(name)

        return record

    def first_output(name: str) -> Any:
        def record(module: torch.nn.Module, args: Any, output: Any) -> None:
            if name not in keeping:
                given = args[0] if args and isinstance(args[0], torch.Tensor) else None
                keeping[name] = (
                    given is not None
                    and isinstance(output, torch.Tensor)
                    and output.shape == given.shape
                    and output.dtype == given.dtype
                )

        return record

    def hook(index: int) -> Any:
        def record(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            calls.append(index)
            hidden = args[0] if args else kwargs.get("hidden_states")
            if isinstance(hidden, torch.Tensor) and index not in inputs:
                inputs[index] = (hidden.shape, hidden.dtype)
            values = list(enumerate(args[1:], 1)) + [
                (k, v) for k, v in kwargs.items() if k != "hidden_states" or not args
            ]
            if not args and "hidden_states" in kwargs:
                values = [(k, v) for k, v in kwargs.items() if k != "hidden_states"]
            for key, value in values:
                if isinstance(value, torch.Tensor) and value.is_floating_point() and value.requires_grad:
                    extras.setdefault(index, {}).setdefault(key, value)

        return record

    handles = [m.register_forward_pre_hook(hook(i), with_kwargs=True) for i, m in enumerate(blocks.modules)]
    handles += [m.register_forward_pre_hook(first_call(name)) for name, m in model.named_modules() if name]
    handles += [m.register_forward_hook(first_output(name)) for name, m in model.named_modules() if name]
    try:
        with quiet_model(model):
            call_model(model, batch)
    finally:
        for handle in handles:
            handle.remove()
    skipped = frozenset(range(len(blocks))) - set(calls)
    if not calls:
        return Probe("the forward runs none of its blocks; a pipeline cut runs them in order", order, inputs)
    if calls != sorted(set(calls)):
        counted = {i: calls.count(i) for i in range(len(blocks))}
        odd = next((i for i, n in counted.items() if n > 1), None)
        if odd is not None:
            return Probe(
                f"block {blocks.names[odd]!r} runs {counted[odd]} times per forward; a pipeline cut runs each block once, in order",
                order,
                inputs,
            )
        return Probe("the blocks run out of their registration order; a pipeline cut runs them in order", order, inputs)
    carried = _one_tensor_for_every_block(extras, calls)
    if carried is None:
        index = min(extras)
        key = next(iter(extras[index]))
        argument = f"argument {key!r}" if isinstance(key, str) else f"positional argument {key}"
        return Probe(
            f"block {blocks.names[index]!r} reads an activation besides its hidden state ({argument}, a tensor with "
            "gradients computed by another module) that is not the same tensor for every block (computed between "
            "blocks, such as a position bias the first block returns); a pipeline cut carries the hidden state and "
            "the activations every block shares",
            order,
            inputs,
        )
    return Probe(None, order, inputs, frozenset(n for n, kept in keeping.items() if kept), skipped, tuple(carried))


def _one_tensor_for_every_block(
    extras: dict[int, dict[int | str, torch.Tensor]], calls: list[int]
) -> dict[int | str, torch.Tensor] | None:
    """The other activation arguments when every block that runs gets the same ones, each one tensor (the embedding
    output a value-residual model hands every block): those a stage can carry on. None when they differ (an
    activation computed between blocks, such as a bias the first block returns): no cut carries those."""
    if not extras:
        return {}
    first = extras.get(calls[0], {})
    for index in calls:
        mine = extras.get(index, {})
        if mine.keys() != first.keys() or any(mine[k] is not first[k] for k in first):
            return None
    return dict(first)


def reference(model: torch.nn.Module, batches: list[Any]) -> tuple[float, dict[str, torch.Tensor]]:
    """The whole model's mean loss and gradients over the micro-batches, in eval mode.

    Each micro-batch runs on its own, as the schedule runs it: stacking them into one batch gives the mean of
    their losses only for a loss that is a mean over rows, and a balancing loss (a product of means over the
    batch's tokens) is not one.
    """
    losses, total = [], {}
    for batch in batches:
        loss, grads = whole_model_reference(model, batch)
        losses.append(loss)
        for name, grad in grads.items():
            total[name] = grad / len(batches) if name not in total else total[name].add_(grad, alpha=1 / len(batches))
    return sum(losses) / len(losses), total


def dry_run(pipeline: Any, batch: Any, probe: Probe, headline: str) -> None:
    """Each local stage's forward alone (zeros for the received activation) before any rank waits on another:
    a stage the cut broke (a model that inspects the blocks it calls) fails here on its own rank, and every
    pipeline rank raises together instead of one crashing while its peer waits for an activation."""
    executor, problem = pipeline.executor, None
    with quiet_model(pipeline.model), torch.no_grad():
        for stage in executor.layout.stages_of(executor.rank):
            start = pipeline.ranges[stage].start
            received = None
            if stage > 0 and start in probe.inputs:
                shape, dtype = probe.inputs[start]
                received = torch.zeros(shape, dtype=dtype, device=next(pipeline.model.parameters()).device)
            try:
                executor.forward(stage, batch, [received] if received is not None else None)
            except Exception as err:  # noqa: BLE001 - any failure of the cut stage is the finding
                problem = TwinMismatch(
                    f"stage {stage} fails on its own ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})",
                    float("inf"),
                )
                break
    agree(problem, pipeline.group, headline, "the whole model")


def check(pipeline: Any, batches: list[Any], expected: tuple[float, dict[str, torch.Tensor]], headline: str) -> None:
    """Run one step of the cut model and compare it with ``expected``; ValueError naming the first difference."""
    model = pipeline.model
    ref_losses, ref_grads = expected
    tolerance = tolerance_for(model)
    with quiet_model(model):
        for p in model.parameters():
            p.grad = None
        report = pipeline.train_step(batches, 1.0 / len(batches), contextlib.nullcontext)
        mismatch = None
        mismatch = loss_mismatch(sum(report.losses) / len(report.losses), ref_losses, tolerance, "the step's loss")
        if mismatch is None:
            mismatch = first_gradient_mismatch(_stage_pairs(model, ref_grads, pipeline), ref_grads, tolerance)
    agree(mismatch, pipeline.group, headline, "the whole model's step on the same micro-batches")


def _stage_pairs(
    model: torch.nn.Module, reference: dict[str, torch.Tensor], pipeline: Any
) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """This stage's gradients beside the whole model's (a silenced tied copy counts once, through its tie)."""
    silenced = tuple(n + "." for n in pipeline.ties.silenced)
    for name, p in model.named_parameters():
        ref = reference.get(name)
        if ref is None or name.startswith(silenced) and name not in pipeline.ties.names:
            continue
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        if grad.shape == ref.shape:  # otherwise reshaped by the cut: compared through the loss
            yield name, grad, ref
