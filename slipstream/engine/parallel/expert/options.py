"""What expert parallelism needs from the config, read and checked once."""

from __future__ import annotations

import dataclasses

from slipstream.engine.config import ConfigError, MeshSizes


@dataclasses.dataclass(frozen=True)
class ExpertOptions:
    """``expert_parallel.autoep_size``: how many ranks share one layer's experts."""

    size: int

    @classmethod
    def from_config(cls, sizes: MeshSizes, optimizer_built: bool) -> ExpertOptions | None:
        """None when ep is 1. ``optimizer_built``: the user passed an optimizer instance, which holds every
        expert, though this rank will keep only its own (refused, naming the key)."""
        ep = sizes.size("ep")
        if ep == 1:
            return None
        if optimizer_built:
            raise ConfigError(
                "expert_parallel.autoep_size: an optimizer built before initialize() holds the unsharded experts; pass the "
                "optimizer in the config or as a callable, optimizer=lambda params: torch.optim.AdamW(params, ...)"
            )
        return cls(ep)
