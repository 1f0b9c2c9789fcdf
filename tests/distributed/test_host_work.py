"""Host work per step does not grow with the number of parameter tensors (issue 50): the same collectives and the
same host synchronisations per step (none) for a model of 20 tensors as for one of 200, at every ZeRO stage on 2 ranks;
and slipstream's own Python per tensor is a gradient hook's few calls, counted.

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
from tests.harness import run_distributed

SIZES = (20, 200)
SYNCS = frozenset({"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy", "nonzero", "cpu"})
PACKAGE = str(Path(slipstream.__file__).resolve().parent)
CALLS_PER_TENSOR = 5  # a gradient hook: the strategy's, the bucket launcher's and the gradient storage's frames (3 at stages 0 and 3, 4 at stage 2, 5 at stage 1)


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


def _measure(stage: int, tensors: int) -> dict[str, Any]:
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
        engine = slipstream.initialize(Chain(tensors), config)
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
    return {f"{stage}/{n}": _measure(stage, n) for stage in (0, 1, 2, 3) for n in SIZES}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_host_work_per_step_does_not_grow_with_the_tensor_count(results: list[dict[str, Any]], stage: int) -> None:
    for rank, found in enumerate(results):
        small, large = found[f"{stage}/{SIZES[0]}"], found[f"{stage}/{SIZES[1]}"]
        assert small["collectives"] == large["collectives"], (rank, small["collectives"], large["collectives"])
        # none: every parameter was used here, so the flags are not read back, and fp32 has no overflow check, so
        # the norm stays on the device ([Note: the step does not wait for the device])
        assert small["syncs"] == large["syncs"] == 0, (rank, small["syncs"], large["syncs"])
        per_tensor = (large["calls"] - small["calls"]) / (SIZES[1] - SIZES[0])
        assert per_tensor <= CALLS_PER_TENSOR, (
            f"stage {stage} rank {rank}: {per_tensor:.1f} slipstream calls per tensor per step"
        )


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(2, _body)
