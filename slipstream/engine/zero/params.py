"""Set-up steps every strategy shares: indexed trainable parameters, sane optimizer groups."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from slipstream.engine.config import ConfigError
from slipstream.engine.zero.strategy import OptimizerFactory, ParamGroupSpec
from slipstream.utils.logging import get_logger

logger = get_logger(__name__)


class TrainableParams:
    """The model's parameters as every strategy sees them: named, trainable ones indexed, groups checked.

    Every rank already starts from rank 0's weights: ``parallelize`` synchronised them once, world-wide,
    before any parallelism cut the model (engine/parallel/weights.py).
    """

    def __init__(self, module: torch.nn.Module, groups: list[ParamGroupSpec]) -> None:
        named = list(module.named_parameters())
        self.names = {id(p): n for n, p in named}
        self.trainable = [p for _, p in named if p.requires_grad]
        self.index = {id(p): i for i, p in enumerate(self.trainable)}
        check_groups(groups, self.index, self.names)


def check_groups(groups: list[ParamGroupSpec], index: dict[int, int], names: dict[int, str]) -> None:
    seen: set[int] = set()
    for group in groups:
        for p in group.params:
            if id(p) not in names:
                raise ConfigError("optimizer/model_parameters: holds a tensor that is not a parameter of the model")
            if id(p) in seen:
                raise ConfigError(f"optimizer/model_parameters: parameter {names[id(p)]!r} appears in two groups")
            seen.add(id(p))
    frozen = [names[i] for i in seen if i not in index]
    if frozen:
        logger.debug("frozen parameters in optimizer groups are skipped: %s", ", ".join(frozen[:5]))
    missing = [names[i] for i in index if i not in seen]
    if missing:
        logger.warning(
            "%d trainable parameter(s) are in no optimizer group and will not be updated (e.g. %s)",
            len(missing),
            ", ".join(missing[:3]),
        )


def single_dtype(params: list[torch.nn.Parameter], stage: int) -> torch.dtype:
    """The one dtype of ``params``, which share flat buffers (fp32 when there are none)."""
    dtypes = {p.dtype for p in params}
    if len(dtypes) > 1:
        raise ValueError(
            f"ZeRO stage {stage}: parameters have mixed dtypes {sorted(map(str, dtypes))}; they share flat "
            "buffers of one dtype, so cast the model to one dtype (the bf16/fp16 config options do this)"
        )
    return dtypes.pop() if dtypes else torch.float32


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))


def bind_optimizer(
    optimizer: torch.optim.Optimizer | OptimizerFactory,
    groups: list[ParamGroupSpec],
    index: dict[int, int],
    targets: Callable[[int], list[torch.Tensor]],
) -> torch.optim.Optimizer:
    """Point the optimizer at the tensors this rank updates instead of the model's parameters.

    ``targets(i)`` gives them for trainable parameter ``i``: its fp32 master, the parameter itself,
    or this rank's slices of it. Frozen parameters drop out. A user's optimizer instance is rebound
    in place, which is only safe while it has no state; a factory builds one over the targets.
    """

    def updated_by_this_rank(params: list[torch.Tensor]) -> list[torch.Tensor]:
        return [t for p in params if id(p) in index for t in targets(index[id(p)])]

    if isinstance(optimizer, torch.optim.Optimizer):
        strangers = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in index and p.requires_grad]
        if strangers:  # dropping them would leave weights untrained, silently
            shapes = ", ".join(str(tuple(p.shape)) for p in strangers[:3])
            raise ConfigError(
                f"optimizer: holds {len(strangers)} trainable tensor(s) that are not parameters of the model being trained "
                f"(shapes {shapes}{', ...' if len(strangers) > 3 else ''}); build the optimizer over model.parameters() "
                "of this model, or pass a callable params -> optimizer"
            )
        trainable = [p for g in optimizer.param_groups for p in g["params"] if id(p) in index]
        if any(len(targets(index[id(p)])) != 1 or targets(index[id(p)])[0] is not p for p in trainable):
            if optimizer.state:
                raise ConfigError(
                    "optimizer: already has state; pass a fresh optimizer (or a callable params -> optimizer) "
                    "so slipstream can point it at the fp32 weights this rank updates"
                )
            for g in optimizer.param_groups:
                g["params"] = updated_by_this_rank(g["params"])
        return optimizer
    # Groups without a trainable parameter are dropped on every rank alike; a group whose
    # parameters this rank owns no slice of stays (empty), so group indices match across ranks.
    return optimizer(
        [
            {**g.options, "params": updated_by_this_rank(g.params)}
            for g in groups
            if any(id(p) in index for p in g.params)
        ]
    )


def slice_state(optimizer: torch.optim.Optimizer, optimizer_param: torch.Tensor | None) -> dict[str, Any] | None:
    """The optimizer's state of one checkpoint slice (``optimizer.state[optimizer_param]``); None when frozen or unstepped."""
    if optimizer_param is None:
        return None
    return optimizer.state.get(optimizer_param) or None


def install_slice_state(
    optimizer: torch.optim.Optimizer, optimizer_param: torch.Tensor | None, state: dict[str, Any] | None
) -> None:
    """Inverse of :func:`slice_state` (None clears the state)."""
    if state is None:
        optimizer.state.pop(optimizer_param, None)
    else:
        optimizer.state[optimizer_param] = state
