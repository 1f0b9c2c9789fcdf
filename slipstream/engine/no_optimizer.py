"""The optimizer of an engine built for inference: it holds no state and refuses to step.

[Note: why a placeholder rather than None] Evaluation before training, prediction and ZeRO-3
inference need the sharding strategy (its forward hooks gather the units) but no optimizer. Every
strategy binds *some* optimizer to the tensors it updates; handing it this one keeps the strategies
unchanged and allocates no optimizer state. The engine checks for it and raises a clear error from
``backward``/``step`` instead of an AttributeError deep inside a strategy.
"""

from __future__ import annotations

from typing import Any

import torch

from slipstream.errors import UsageError

MISSING_OPTIMIZER = (
    'this engine has no optimizer (initialize() got inference=True, or neither an "optimizer" section in the '
    'config nor optimizer=); to train, add an "optimizer" section to the config or pass optimizer= to '
    "slipstream.initialize()"
)


class NoOptimizer(torch.optim.Optimizer):
    """Parameter groups for bookkeeping (``lr`` 0) and nothing else."""

    def __init__(self, param_groups: list[dict[str, Any]]) -> None:
        groups = [{**g, "params": list(g["params"])} for g in param_groups] or [{"params": []}]
        super().__init__(groups, {"lr": 0.0})

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        raise UsageError(f"optimizer.step: {MISSING_OPTIMIZER}")
