"""The checkpoint methods a ZeRO strategy overrides when its optimizer state is offloaded.

Stages 1/2 and 3 keep an offloaded partition the same way (a ``PartitionOffload`` in
``self.offload``, ``None`` without offload), so one mixin serves both. ``offload/checkpoint.py``
is imported only when offload is on: a run without it never loads the aio and CPU Adam code.
"""

from __future__ import annotations

from typing import Any

from slipstream.engine.zero.slices import OwnedSlice


class OffloadCheckpointHooks:
    """Put before ``ShardingStrategy`` in the bases; falls through to it when ``self.offload`` is None."""

    offload: Any

    def slice_optimizer_state(self, owned: OwnedSlice) -> dict[str, Any] | None:
        if self.offload is None:
            return super().slice_optimizer_state(owned)  # type: ignore[misc]
        from slipstream.engine.zero.offload.checkpoint import slice_state

        return slice_state(self.offload, owned)

    def load_slice_optimizer_state(self, owned: OwnedSlice, state: dict[str, Any] | None) -> None:
        if self.offload is None:
            return super().load_slice_optimizer_state(owned, state)  # type: ignore[misc]
        from slipstream.engine.zero.offload.checkpoint import load_slice_state

        load_slice_state(self.offload, owned, state)

    def load_sharded_state(self, read: Any) -> None:
        if self.offload is None:
            return super().load_sharded_state(read)  # type: ignore[misc]
        from slipstream.engine.zero.offload.checkpoint import load_masters

        load_masters(self.offload, self.sharded_state(), read)  # type: ignore[attr-defined]
        self.refresh_from_masters()  # type: ignore[attr-defined]
