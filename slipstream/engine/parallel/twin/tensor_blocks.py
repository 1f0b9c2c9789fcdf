"""Tensor parallel's block twin: each sharded block must reproduce the unsharded one on its recorded inputs.

[Note: why a block twin] A wrong plan (a row layer marked column, a packed projection cut across
its parts, an attribute that still holds the full head count) often still runs: shapes can line up
and training proceeds, silently wrong. So before cutting, the probe run (``tensor/probe.py``)
records every block's inputs and outputs on one fixed tiny batch; after cutting the same inputs go
through each sharded block on the tp group. The first block whose output differs beyond the
table's "block" tolerance ([Note: the tolerance table]) fails ``initialize`` through the harness's
verdict, naming the block and its plan entries, on every rank of the tp group at once. It runs
block by block, before the whole-model twin (``harness.check_whole_model``), because it names the
block and lets tensor parallel fall back to gathering that block's projections; the whole-model
twin then checks what no block sees (vocabulary shards, the loss, replicated gradients).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from slipstream.engine.parallel.twin.harness import TwinMismatch, agree

if TYPE_CHECKING:
    from slipstream.engine.parallel.tensor.plan import PlanEntry


def tensors_of(value: Any) -> list[torch.Tensor]:
    """Every tensor of a block's output (tensors, tuples and lists of them, a transformers ``ModelOutput``)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_of(v)]
    if hasattr(value, "to_tuple"):  # transformers ModelOutput
        return tensors_of(value.to_tuple())
    return []


def _replay(block: torch.nn.Module, call: tuple[tuple[Any, ...], dict[str, Any]], want: Any, tolerance: float) -> str:
    """What is wrong with the sharded ``block`` on its recorded call, or ''."""
    args, kwargs = call
    modes = {m: m.training for m in block.modules()}
    block.eval()
    try:
        with torch.no_grad():
            got = tensors_of(block(*args, **kwargs))
        expected = tensors_of(want)
        if len(got) != len(expected) or any(g.shape != w.shape for g, w in zip(got, expected)):
            return f"output shapes {[tuple(g.shape) for g in got]} instead of {[tuple(w.shape) for w in expected]}"
        worst = max(
            float((g.float() - w.float()).abs().max() / w.float().abs().max().clamp_min(1.0))
            for g, w in zip(got, expected)
        )
        return "" if worst <= tolerance else f"outputs differ by {worst:.3g} relative (limit {tolerance:g})"
    except Exception as err:  # noqa: BLE001 - a wrong plan shows up as any error inside the block
        return f"raised {type(err).__name__}: {err}"
    finally:
        for module, mode in modes.items():
            module.training = mode


def verify(
    calls: Sequence[tuple[tuple[Any, ...], dict[str, Any]] | None],
    outputs: Sequence[Any],
    blocks: Sequence[torch.nn.Module],
    names: Sequence[str],
    plan: Sequence[PlanEntry],
    group: dist.ProcessGroup,
    tolerance: float,
) -> None:
    """Replay each block's recorded call (the probe run's) on the sharded model; every tp rank raises naming the
    first block that differs."""
    for i, block in enumerate(blocks):
        call = calls[i]
        if call is None:
            continue  # a block the probe batch did not reach
        problem = _replay(block, call, outputs[i], tolerance)

        def message(finding: str, rank: int, name: str = names[i]) -> str:  # called only on a mismatch
            entries = "; ".join(e.describe() for e in plan if e.name.startswith(name + ".")) or "none"
            return (
                f"tensor_parallel: the sharded block {name} does not reproduce the unsharded one on the self-check "
                f"batch ({finding} on tp rank {rank}); its plan entries: {entries}. "
                "Fix tensor_parallel.partition_config (row/column per layer, shape [parts, -1] for packed projections)"
            )

        agree(TwinMismatch(problem, float("inf")) if problem else None, group, "tensor_parallel", message=message)
