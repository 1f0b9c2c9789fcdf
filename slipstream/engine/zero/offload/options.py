"""The offload knobs a strategy needs (built once from the config by ``engine/options.py``).

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
