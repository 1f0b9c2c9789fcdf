"""The offload knobs a strategy needs, copied once out of the config, and the checks on them.

[Note: sub-group size] DeepSpeed's ``sub_group_size`` default (1e9 elements) makes its NVMe path
allocate RAM buffers as large as the whole partition, which is why its NVMe offload *lowers*
capacity. Here the NVMe buffers are always bounded: without an explicit ``sub_group_size`` the
optimizer swaps in sub-groups of ``AUTO_SUB_GROUP_NUMEL`` elements (3 buffers x 3 fp32 tensors
x 8M elements = 288 MB), large enough that each read and write is a long sequential transfer.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

Device = Literal["none", "cpu", "nvme"]
AUTO_SUB_GROUP_NUMEL = 8 * 2**20


@dataclasses.dataclass(frozen=True)
class AioOptions:
    block_size: int = 1 << 20
    threads: int = 8  # I/O requests in flight (one pool thread each)
    use_direct: bool = True


@dataclasses.dataclass(frozen=True)
class OffloadOptions:
    optimizer: Device = "none"
    param: Device = "none"
    optimizer_nvme_path: str | None = None
    param_nvme_path: str | None = None
    pin_memory: bool = True
    sub_group_numel: int = AUTO_SUB_GROUP_NUMEL
    aio: AioOptions = dataclasses.field(default_factory=AioOptions)

    @property
    def active(self) -> bool:
        return self.optimizer != "none" or self.param != "none"


def offload_options(zero: object, aio: object) -> OffloadOptions | None:
    """Read ``zero_optimization.offload_*`` and ``aio``; ValueError (``zero_optimization.…: …``) on misuse."""
    stage = zero.stage  # type: ignore[attr-defined]
    optimizer_cfg, param_cfg = zero.offload_optimizer, zero.offload_param  # type: ignore[attr-defined]
    optimizer = optimizer_cfg.device if optimizer_cfg is not None else "none"
    param = param_cfg.device if param_cfg is not None else "none"
    if optimizer == "none" and param == "none":
        return None
    if stage == 0:
        raise ValueError(
            "zero_optimization.offload_optimizer.device: offload needs ZeRO stage 1, 2 or 3 (the optimizer state "
            "it moves is partitioned); set zero_optimization.stage"
        )
    if param != "none" and stage != 3:
        raise ValueError(f"zero_optimization.offload_param.device: parameter offload needs stage 3, got stage {stage}")
    if param != "none" and optimizer == "none":
        raise ValueError(
            "zero_optimization.offload_param.device: parameter offload needs offload_optimizer too (device \"cpu\" or "
            "\"nvme\"): the fp32 masters of offloaded parameters live with the offloaded optimizer state"
        )
    for name, device, cfg in (("offload_optimizer", optimizer, optimizer_cfg), ("offload_param", param, param_cfg)):
        if device == "nvme" and not cfg.nvme_path:
            raise ValueError(f"zero_optimization.{name}.nvme_path: required when {name}.device is \"nvme\" (a directory on a local SSD)")
    explicit = "sub_group_size" in zero.model_fields_set  # type: ignore[attr-defined]
    threads = max(1, aio.queue_depth) * max(1, aio.intra_op_parallelism)  # type: ignore[attr-defined]
    pins = [cfg.pin_memory for cfg in (optimizer_cfg, param_cfg) if cfg is not None and cfg.device != "none"]
    return OffloadOptions(
        optimizer=optimizer,
        param=param,
        optimizer_nvme_path=optimizer_cfg.nvme_path if optimizer == "nvme" else None,
        param_nvme_path=param_cfg.nvme_path if param == "nvme" else None,
        pin_memory=all(pins),
        sub_group_numel=zero.sub_group_size if explicit else AUTO_SUB_GROUP_NUMEL,  # type: ignore[attr-defined]
        aio=AioOptions(block_size=aio.block_size, threads=threads),  # type: ignore[attr-defined]
    )
