"""What tensor (+ sequence) parallelism needs from the config, read and checked once."""

from __future__ import annotations

import dataclasses
from typing import Any

from slipstream.engine.config import ConfigError, MeshSizes, SlipstreamConfig
from slipstream.engine.parallel.tensor.plan import validate_partition_config


@dataclasses.dataclass(frozen=True)
class TensorOptions:
    """``tensor_parallel.*``: the size, the optional plan and sequence parallelism."""

    size: int
    sequence_parallel: bool
    partition_config: dict[str, Any] | None
    twin_check: bool

    @classmethod
    def from_config(cls, cfg: SlipstreamConfig, sizes: MeshSizes, presharded: bool) -> TensorOptions | None:
        """None when tp is 1; :class:`ConfigError` naming the key otherwise (the plan itself is checked on the model).

        ``presharded``: the model was built under ``zero.Init`` and holds only this rank's flat shards.
        """
        section = cfg.tensor_parallel
        validate_partition_config(section.partition_config)
        if section.sequence_parallel and sizes.tp < 2:
            raise ConfigError(
                "tensor_parallel.sequence_parallel: needs tensor_parallel.autotp_size of 2 or more; set one or remove it"
            )
        if sizes.tp == 1:
            return None
        if presharded:
            raise ConfigError(
                "tensor_parallel.autotp_size: a model built under slipstream.zero.Init cannot be cut for tensor parallelism; build it normally"
            )
        return cls(sizes.tp, section.sequence_parallel, section.partition_config, cfg.twin_check)
