"""fp32 master weights and the optimizer over them: one interface, on the device or offloaded.

A partitioned strategy (stages 1, 2, 3) reduces gradients into its partition and then hands the
rest of the step to a :class:`MasterWeights`: bind the reduced gradients, report their norm, scale
them, step, and write the updated weights into the parameters of the partition. Where the
masters live is the only difference between the two implementations:

* :class:`DeviceMasters`: next to the parameters. A bf16/fp16 model gets an fp32 copy of the
  partition; an fp32 model's partition *is* its masters (no copy). The optimizer is the user's
  (or the config's), rebound to one master view per optimized piece.
* :class:`OffloadedMasters`: in CPU memory or on NVMe with the Adam moments, stepped by the CPU
  Adam (``offload/``). Loaded only when offload is configured.

Both receive a :class:`PartitionSpec` and nothing else of the strategy.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

import torch

from slipstream.engine.zero.offload.chunks import Chunks, copy_in, copy_out, overlaps
from slipstream.engine.zero.params import bind_optimizer, install_slice_state, optimizer_state_bytes, slice_state
from slipstream.engine.zero.partition import PartitionSpec
from slipstream.engine.zero.slices import OwnedSlice
from slipstream.engine.zero.strategy import OptimizerFactory, ParamGroupSpec
from slipstream.utils.pieces import ParamSlice


class MasterWeights(abc.ABC):
    """What a strategy calls once its gradients are reduced into the partition (``spec.grads()``)."""

    optimizer: torch.optim.Optimizer

    def __init__(self, spec: PartitionSpec) -> None:
        self.spec = spec

    def gradients_ready(self, used: list[bool]) -> None:
        """The reduced gradients are final; ``used[i]`` says whether trainable parameter i got one on any rank."""
        self.prepare_gradients()
        self.use_gradients(used)

    @abc.abstractmethod
    def prepare_gradients(self) -> None:
        """The reduced gradients are final: make them what the norm and the optimizer read (no collective)."""

    @abc.abstractmethod
    def use_gradients(self, used: list[bool]) -> None:
        """Hand the optimizer the gradients of the parameters ``used`` on any rank (the others step with none)."""

    @abc.abstractmethod
    def _reduced_grads(self) -> Chunks:
        """The gradients the optimizer will read (fp32 copies or the reduced ones), partition coordinates."""

    def grad_norm_squared(self, lo: int, hi: int) -> torch.Tensor:
        """Squared L2 norm of this rank's gradients over ``[lo, hi)`` (a 1-element fp32 tensor on the device)."""
        squared = torch.zeros(1, dtype=torch.float32, device=self.spec.device)
        for _, _, view in overlaps(self._reduced_grads(), lo, hi):
            squared += torch.linalg.vector_norm(view, dtype=torch.float32) ** 2
        return squared

    @abc.abstractmethod
    def scale_gradients(self, factor: float | torch.Tensor) -> None:
        """Multiply the gradients the optimizer reads by ``factor`` (a device scalar: no host read, see optimizer_step.py)."""

    @abc.abstractmethod
    def step(self) -> None:
        """Update the masters and write the new values into the partition's parameters."""

    @abc.abstractmethod
    def zero_grad(self) -> None: ...

    @abc.abstractmethod
    def read(self, lo: int, hi: int) -> torch.Tensor:
        """fp32 masters over ``[lo, hi)`` of the partition (consolidation)."""

    @abc.abstractmethod
    def write(self, lo: int, values: torch.Tensor) -> None:
        """Overwrite the masters from ``lo`` (a user modified the weights, e.g. ``GatheredParameters``)."""

    @abc.abstractmethod
    def publish(self) -> None:
        """Make the partition's parameters show the masters (after a checkpoint load)."""

    @abc.abstractmethod
    def owned_slices(self, pieces: list[tuple[ParamSlice, int]]) -> list[OwnedSlice]:
        """One checkpoint slice per ``(slice, partition offset)``; frozen pieces get no optimizer tensor."""

    @abc.abstractmethod
    def slice_optimizer_state(self, owned: OwnedSlice) -> dict[str, Any] | None: ...

    @abc.abstractmethod
    def load_slice_optimizer_state(self, owned: OwnedSlice, state: dict[str, Any] | None) -> None: ...

    def load(self, owned: list[OwnedSlice], read: Callable[[ParamSlice], torch.Tensor]) -> None:
        """Fill every slice with ``read(slice)`` (any checkpoint slicing); the caller then publishes."""
        with torch.no_grad():
            for o in owned:
                o.value.copy_(read(o.slice).reshape(-1))

    def gradient_buffer(self, name: str, numel: int) -> torch.Tensor:
        """A zeroed gradient chunk for the strategy to reduce into (offload may map it from a file)."""
        return torch.zeros(numel, dtype=self.spec.dtype, device=self.spec.device)

    @abc.abstractmethod
    def memory_bytes(self) -> int:
        """Optimizer state plus fp32 masters held by this rank (offload: in CPU memory, NVMe buffers only)."""

    def close(self) -> None:
        pass


class DeviceMasters(MasterWeights):
    def __init__(
        self,
        spec: PartitionSpec,
        optimizer: torch.optim.Optimizer | OptimizerFactory,
        groups: list[ParamGroupSpec],
        index: dict[int, int],
    ) -> None:
        super().__init__(spec)
        self.params = spec.params
        self.low_precision = spec.dtype != torch.float32
        # [Note: parameters offloaded, optimizer on the device] ZeRO-3's offload_param alone keeps
        # the parameter shard in CPU memory (or NVMe swap files) while the optimizer steps on the
        # device, as DeepSpeed allows. The optimizer then steps a device copy (``flat``) even in
        # fp32, and each step writes the result back: into the CPU shard, or through ``publish``
        # into the swap files.
        self.offloaded = spec.params is None or any(t.device != spec.device for t in spec.params.tensors)
        self.flat: torch.Tensor | None = None  # the fp32 copy (None: the parameters are the masters)
        if self.low_precision or self.offloaded:
            self.flat = torch.zeros(spec.numel, dtype=torch.float32, device=spec.device)
            copy_out(spec.initial, self.flat, 0)
        self.views = {p.offset: self._view(p.offset, p.numel) for p in spec.pieces}  # what the optimizer steps
        targets: dict[int, list[torch.Tensor]] = {}
        for p in spec.pieces:
            targets.setdefault(p.param, []).append(self.views[p.offset])
        self.optimizer = bind_optimizer(optimizer, groups, index, lambda i: targets.get(i, []))
        self.grad32: torch.Tensor | None = None
        self._views_of: tuple[tuple[int, int], ...] | None = None
        self._cached_views: dict[int, torch.Tensor] = {}

    def _view(self, offset: int, numel: int) -> torch.Tensor:
        if self.flat is not None:
            return self.flat[offset : offset + numel]
        assert self.params is not None
        return self.params.slice(offset, numel)

    def prepare_gradients(self) -> None:
        if self.low_precision:  # the optimizer steps fp32 masters: give it fp32 gradients
            self.grad32 = torch.zeros(self.spec.numel, dtype=torch.float32, device=self.spec.device)
            copy_out(self.spec.grads(), self.grad32, 0)

    def use_gradients(self, used: list[bool]) -> None:
        views = self._grad_views(self._reduced_grads())
        for p in self.spec.pieces:
            self.views[p.offset].grad = views[p.offset] if used[p.param] else None

    def _grad_views(self, grads: Chunks) -> dict[int, torch.Tensor]:
        """Each piece's view of ``grads``, made again only when the buffers behind them change (they persist from
        step to step: a view per piece per step is Python work that grows with the parameter count)."""
        key = tuple((t.data_ptr(), t.numel()) for t in grads.tensors)
        if key != self._views_of:
            self._views_of = key
            self._cached_views = {p.offset: grads.slice(p.offset, p.numel) for p in self.spec.pieces}
        return self._cached_views

    def _reduced_grads(self) -> Chunks:
        return Chunks.flat(self.grad32) if self.grad32 is not None else self.spec.grads()

    def scale_gradients(self, factor: float | torch.Tensor) -> None:
        if isinstance(factor, torch.Tensor) or factor != 1.0:
            for g in self._reduced_grads().tensors:
                g.mul_(factor)

    def step(self) -> None:
        self.optimizer.step()
        self.publish()

    def zero_grad(self) -> None:
        self.grad32 = None
        for view in self.views.values():
            view.grad = None

    def read(self, lo: int, hi: int) -> torch.Tensor:
        if self.flat is not None:
            return self.flat[lo:hi].clone()
        assert self.params is not None
        out = torch.zeros(hi - lo, dtype=torch.float32, device=self.spec.device)
        copy_out(self.params, out, lo)
        return out

    def write(self, lo: int, values: torch.Tensor) -> None:
        with torch.no_grad():
            if self.flat is not None:
                self.flat[lo : lo + values.numel()].copy_(values)
            else:
                assert self.params is not None
                copy_in(self.params, values, lo)

    def publish(self) -> None:
        if self.flat is None:
            return
        with torch.no_grad():
            if self.params is not None:
                copy_in(self.params, self.flat, 0)
            else:
                assert self.spec.publish is not None, "parameters neither resident nor published"
                self.spec.publish(0, 0, self.flat.to(self.spec.dtype))

    def owned_slices(self, pieces: list[tuple[ParamSlice, int]]) -> list[OwnedSlice]:
        owned = []
        for piece, offset in pieces:
            view = self.views.get(offset)
            value = view if view is not None else self._view(offset, piece.numel)
            owned.append(OwnedSlice(piece, value, view))
        return owned

    def slice_optimizer_state(self, owned: OwnedSlice) -> dict[str, Any] | None:
        return slice_state(self.optimizer, owned.optimizer_param)

    def load_slice_optimizer_state(self, owned: OwnedSlice, state: dict[str, Any] | None) -> None:
        install_slice_state(self.optimizer, owned.optimizer_param, state)

    def memory_bytes(self) -> int:
        return optimizer_state_bytes(self.optimizer) + (0 if self.flat is None else self.flat.numel() * 4)


class OffloadedMasters(MasterWeights):
    """The masters and Adam moments off the device (``offload/partition.py``); the CPU Adam steps them."""

    def __init__(
        self,
        spec: PartitionSpec,
        options: Any,
        optimizer: torch.optim.Optimizer | OptimizerFactory,
        groups: list[ParamGroupSpec],
        index: dict[int, int],
    ) -> None:
        from slipstream.engine.zero.offload.partition import PartitionOffload

        super().__init__(spec)
        self.offload = PartitionOffload(options, spec, optimizer, groups, index)
        self.optimizer = self.offload.optimizer

    def prepare_gradients(self) -> None:
        self.offload.prepare_gradients()

    def use_gradients(self, used: list[bool]) -> None:
        self.offload.use_gradients(used)

    def _reduced_grads(self) -> Chunks:
        return self.spec.grads()  # the CPU Adam reads them in the model's dtype

    def scale_gradients(self, factor: float | torch.Tensor) -> None:
        # applied by the CPU Adam as it reads each gradient; the host steps, so it reads the factor anyway
        self.offload.grad_scale = float(factor)

    def step(self) -> None:
        self.optimizer.step()  # writes the updated parameters itself (in place, or through publish)

    def zero_grad(self) -> None:
        self.offload.zero_grad()

    def read(self, lo: int, hi: int) -> torch.Tensor:
        return self.offload.masters(lo, hi)

    def write(self, lo: int, values: torch.Tensor) -> None:
        self.offload.write("master", lo, values)

    def publish(self) -> None:
        self.offload.publish_masters()

    def owned_slices(self, pieces: list[tuple[ParamSlice, int]]) -> list[OwnedSlice]:
        from slipstream.engine.zero.offload.checkpoint import offload_slices

        return offload_slices(self.offload, pieces)

    def slice_optimizer_state(self, owned: OwnedSlice) -> dict[str, Any] | None:
        from slipstream.engine.zero.offload.checkpoint import slice_state as offload_state

        return offload_state(self.offload, owned)

    def load_slice_optimizer_state(self, owned: OwnedSlice, state: dict[str, Any] | None) -> None:
        from slipstream.engine.zero.offload.checkpoint import load_slice_state

        load_slice_state(self.offload, owned, state)

    def load(self, owned: list[OwnedSlice], read: Callable[[ParamSlice], torch.Tensor]) -> None:
        from slipstream.engine.zero.offload.checkpoint import load_masters

        load_masters(self.offload, owned, read)

    def gradient_buffer(self, name: str, numel: int) -> torch.Tensor:
        return self.offload.new_gradient(name, numel, self.spec.device)

    def memory_bytes(self) -> int:
        return self.offload.memory_bytes()

    def close(self) -> None:
        self.offload.close()


def build_masters(
    spec: PartitionSpec,
    offload: Any,
    optimizer: torch.optim.Optimizer | OptimizerFactory,
    groups: list[ParamGroupSpec],
    index: dict[int, int],
) -> MasterWeights:
    """Offloaded when ``offload`` (OffloadOptions) moves the optimizer, else on the device."""
    if offload is not None and offload.optimizer != "none":
        return OffloadedMasters(spec, offload, optimizer, groups, index)
    return DeviceMasters(spec, optimizer, groups, index)
