"""Host work per step does not grow with the number of parameter tensors (issue 50): the same collectives and the
same host synchronisations per step (none) for a model of 20 tensors as for one of 200, at every ZeRO stage on 2 ranks;
and slipstream's own Python calls per step are the same too (stages 0-2 count gradients in C++; ZeRO-3's work is per
unit, counted separately).

The model is benchmarks/bench_overhead.py's chain of tiny linear layers: its arithmetic is nothing, so what a
step does on the host is all there is. Synchronisations are counted where a tensor's value reaches Python
(``item``, ``tolist``, ``bool``, ``float``, ...; on CUDA each waits for the device) by a TorchFunctionMode around
the step; collectives by the comms log; Python calls by cProfile, in slipstream's own files.
"""

from __future__ import annotations

import cProfile
import pstats
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

import slipstream
from benchmarks.bench_overhead import Chain
from slipstream.accelerator import get_accelerator
from slipstream.comm import comms_log
from slipstream.ops import builder
from slipstream.ops.specs import GRAD_ARRIVALS
from tests.harness import run_distributed

SIZES = (20, 200)
SYNCS = frozenset({"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy", "nonzero", "cpu"})
PACKAGE = str(Path(slipstream.__file__).resolve().parent)
BLOCKS = 5
CALLS_PER_UNIT = 8  # ZeRO-3: a unit's pre- and post-forward hooks, its backward hooks and its reduction's launch


class _Syncs(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if getattr(func, "__name__", "") in SYNCS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _own_calls(profile: cProfile.Profile) -> int:
    return sum(entry[1] for (path, _, _), entry in pstats.Stats(profile).stats.items() if path.startswith(PACKAGE))  # type: ignore[attr-defined]


class Blocks(torch.nn.Module):
    """``BLOCKS`` blocks of ``tensors // (2 * BLOCKS)`` tiny linear layers each: ZeRO-3's units (the repeated children of
    a ModuleList) stay as many whatever the tensor count, so its per-unit work holds still and per-tensor work shows."""

    def __init__(self, tensors: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        per_block = max(1, tensors // (2 * BLOCKS))
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(per_block))) for _ in range(BLOCKS)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def _measure(stage: int, tensors: int, model: type[torch.nn.Module] = Chain) -> dict[str, Any]:
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 1.0,
        "steps_per_print": 0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 10**8, "allgather_bucket_size": 10**8},
    }
    # The step as on a GPU, whose kernels run behind the host: on a CPU the engine reads the norm, which waits for
    # nothing there ([Note: the step does not wait for the device]).
    accelerator = get_accelerator()
    accelerator.runs_ahead_of_host = True
    try:
        engine = slipstream.initialize(model(tensors), config)
    finally:
        del accelerator.runs_ahead_of_host  # back to the class's
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(torch.distributed.get_rank()))

    def step() -> None:
        engine.backward(engine(x))
        engine.step()

    try:
        for _ in range(2):
            step()
        comms_log.next_step()
        syncs, profile = _Syncs(), cProfile.Profile()
        with syncs:
            profile.enable()
            step()
            profile.disable()
        return {
            "collectives": sorted((r.op, r.tag) for r in comms_log.last),
            "syncs": syncs.count,
            "calls": _own_calls(profile),
        }
    finally:
        engine.close()


def _body() -> dict[str, Any]:
    assert builder.load(GRAD_ARRIVALS) is not None, (
        "the gradient-arrivals op did not build (scripts/setup.sh builds it)"
    )
    found = {f"{stage}/{n}": _measure(stage, n) for stage in (0, 1, 2, 3) for n in SIZES}
    found.update({f"3 blocks/{n}": _measure(3, n, Blocks) for n in SIZES})
    return found


@pytest.mark.parametrize("stage", ["0", "1", "2", "3 blocks"])
def test_host_work_per_step_does_not_grow_with_the_tensor_count(results: list[dict[str, Any]], stage: str) -> None:
    for rank, found in enumerate(results):
        small, large = found[f"{stage}/{SIZES[0]}"], found[f"{stage}/{SIZES[1]}"]
        assert small["collectives"] == large["collectives"], (rank, small["collectives"], large["collectives"])
        # none: every parameter was used here, so the flags are not read back, and fp32 has no overflow check, so
        # the norm stays on the device ([Note: the step does not wait for the device])
        assert small["syncs"] == large["syncs"] == 0, (rank, small["syncs"], large["syncs"])
        # Stages 0-2 count gradients in C++ ([Note: arrivals in C++]) and ZeRO-3's hooks are per unit: with as many
        # units at 200 tensors as at 20, slipstream's Python calls per step are the same.
        per_tensor = (large["calls"] - small["calls"]) / (SIZES[1] - SIZES[0])
        assert per_tensor <= 0.05, f"stage {stage} rank {rank}: {per_tensor:.2f} slipstream calls per tensor per step"


def test_zero3_host_work_grows_with_its_units_only(results: list[dict[str, Any]]) -> None:
    """The chain's every layer is a unit: ZeRO-3's gather, release and reduce per unit is what grows there."""
    for rank, found in enumerate(results):
        small, large = found[f"3/{SIZES[0]}"], found[f"3/{SIZES[1]}"]
        per_unit = (large["calls"] - small["calls"]) / ((SIZES[1] - SIZES[0]) // 2)
        assert per_unit <= CALLS_PER_UNIT, f"rank {rank}: {per_unit:.1f} slipstream calls per ZeRO-3 unit per step"


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(2, _body)
