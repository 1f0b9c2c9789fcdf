"""The optimizer and scheduler objects a host holds while the engine does the stepping.

[Note: why no-op steps] Under DeepSpeed the host's ``optimizer.step()`` and
``lr_scheduler.step()`` do nothing: the engine stepped both inside ``backward`` at the
accumulation boundary (and skipped both on an fp16 overflow). These wrappers keep that contract,
and expose what hosts read: ``param_groups`` (learning rates), ``step_was_skipped``,
``get_last_lr()``. A scheduler the user built over their own optimizer still steps here, once per
applied optimizer step, because the engine does not know it.
"""

from __future__ import annotations

from typing import Any

from accelerate.optimizer import AcceleratedOptimizer


class SlipstreamOptimizer(AcceleratedOptimizer):
    """The engine's optimizer as the host sees it; ``step``/``zero_grad`` belong to the engine."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine.optimizer, device_placement=False, scaler=None)
        self.engine = engine

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        return None  # the engine zeroes its gradient buffers after each optimizer step

    def step(self, closure: Any = None) -> None:
        return None  # engine.step() ran inside accelerator.backward()

    @property
    def step_was_skipped(self) -> bool:
        return not self.engine.was_step_applied()

    def state_dict(self) -> dict[str, Any]:
        return {}  # saved, sharded, in the engine's checkpoint

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        return None


class SlipstreamScheduler:
    """The schedule as the host sees it: the engine's own (config ``scheduler``) or the user's, stepped after applied steps."""

    def __init__(self, engine: Any, user_scheduler: Any = None) -> None:
        self.engine = engine
        self.user_scheduler = user_scheduler

    def step(self, *args: Any, **kwargs: Any) -> None:
        if self.user_scheduler is not None and self.engine.was_step_applied():
            self.user_scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> list[float]:
        return self.engine.get_lr()

    def state_dict(self) -> dict[str, Any]:
        return {}  # saved in the engine's checkpoint (its own schedule, or the user's registered one)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        return None
