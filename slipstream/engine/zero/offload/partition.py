"""``PartitionOffload``: what a ZeRO strategy calls to keep its optimizer partition off the device.

A strategy hands over its partition as one value (``PartitionSpec``: pieces, gradient and
parameter storage in partition coordinates) and from then on calls four things: :meth:`prepare_gradients` and
:meth:`use_gradients` when the reduced gradients are final, ``grad_scale`` (instead of scaling gradients in place), :meth:`step`, and
:meth:`masters` for consolidation. ``optimizer`` is the :class:`OffloadAdam` the engine sees.

[Note: no copies on a CPU device] On CPU the gradients are read where the reduction left them
and a bf16/fp16 model's parameters are written by the Adam kernel straight into the model's
storage; an fp32 model's masters *are* its parameters (optimizer on cpu). On CUDA, gradients go
to a pinned buffer and updated parameters come back with one host-to-device copy per sub-group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from slipstream.accelerator import get_accelerator
from slipstream.comm.context import CommContext, Pending
from slipstream.engine.config.base import ConfigError
from slipstream.engine.zero.offload.adam import OffloadAdam, ParamSink, Segment, adam_hyper
from slipstream.engine.zero.offload.chunks import Chunks, copy_in, copy_out
from slipstream.engine.zero.offload.options import OffloadOptions
from slipstream.engine.zero.offload.state_store import CPUStateStore, NVMeStateStore, StateStore, split
from slipstream.engine.zero.offload.swap_dir import SwapDir
from slipstream.engine.zero.partition import PartitionSpec
from slipstream.engine.zero.strategy import OptimizerFactory, ParamGroupSpec
from slipstream.ops.aio import AsyncIO
from slipstream.utils.logging import get_logger

logger = get_logger(__name__)


class PartitionOffload:
    def __init__(
        self,
        options: OffloadOptions,
        spec: PartitionSpec,
        optimizer: torch.optim.Optimizer | OptimizerFactory,
        groups: list[ParamGroupSpec],
        index: dict[int, int],
    ) -> None:
        """``spec`` describes the partition (partition.py); ``optimizer``, ``groups`` and ``index`` (parameter id
        -> trainable index) give the Adam settings of each piece's optimizer group."""
        numel, dtype, params = spec.numel, spec.dtype, spec.params
        self.options, self.dtype, self.numel = options, dtype, numel
        self.accelerator = get_accelerator()
        on_cuda = spec.device.type == "cuda"
        self.pin = options.pin_memory and on_cuda  # pinning only speeds host-device copies
        hyper, group_of = _hyperparameters(optimizer, groups, index)
        self.segments = [
            Segment(p.offset, p.numel, group_of[p.param], p.param) for p in spec.pieces if p.param in group_of
        ]
        self.segment_of = {s.offset: s for s in self.segments}
        self.swap: SwapDir | None = None
        self.mapped_bytes = 0
        self.io: AsyncIO | None = None
        alias = (
            options.optimizer == "cpu" and params is not None and params.device.type == "cpu" and dtype == torch.float32
        )
        self.store: StateStore
        if options.optimizer == "nvme":
            assert options.optimizer_nvme_path is not None
            self.swap = SwapDir.open(
                options.optimizer_nvme_path, spec.job_id, spec.rank, "zero_optimization.offload_optimizer.nvme_path"
            )
            self.io = AsyncIO(options.aio.block_size, options.aio.threads, options.aio.use_direct)
            subgroups = split(numel, list(spec.boundaries), options.sub_group_numel)
            self.store = NVMeStateStore(numel, subgroups, spec.initial, self.swap, self.io, self.pin)
        else:
            self.store = CPUStateStore(numel, params if alias else None, None if alias else spec.initial, self.pin)
        in_memory = isinstance(self.store, CPUStateStore)
        placeholders: list[list[torch.Tensor]] = [[] for _ in hyper]
        for s in self.segments:
            view = (
                self.store.views["master"].slice(s.offset, s.numel)
                if in_memory
                else torch.empty(s.numel, device="meta")
            )  # type: ignore[attr-defined]
            placeholders[s.group].append(view)
        self._device_grads = spec.grads
        self.grads: Chunks | None = None
        self.context = CommContext(self.accelerator)  # the gradient copy's stream and events (comm/context.py)
        self.copy: Pending | None = None
        if on_cuda:  # gradients cross to CPU memory once per step, into one pinned buffer, on their own stream
            self.grads = Chunks.flat(
                self.accelerator.pinned_empty(numel, dtype) if self.pin else torch.empty(numel, dtype=dtype)
            )
        if params is not None and params.device.type == "cpu":
            sink = ParamSink(dtype, direct=params, aliases_master=alias)
        elif params is not None:
            sink = ParamSink(dtype, publish=self._to_device(params))
        else:
            sink = ParamSink(dtype, publish=spec.publish)
        self.optimizer = OffloadAdam(placeholders, hyper, self.segments, self.store, sink, spec.num_params)
        self.optimizer.before_step = self._wait_for_gradients
        logger.debug(
            "offload: optimizer state of %d elements on %s in %d sub-group(s)%s",
            numel,
            options.optimizer,
            len(self.store.subgroups),
            " (masters alias the parameters)" if alias else "",
        )

    def new_gradient(self, name: str, numel: int, device: torch.device) -> torch.Tensor:
        """A zeroed gradient chunk for the strategy to reduce into.

        [Note: gradients on NVMe] With the optimizer state on NVMe and a CPU device, ZeRO-3's
        gradient shards (4 bytes per parameter / N, the largest thing left in RAM) are mapped from
        swap files (``MAP_SHARED``): the kernel writes them back and drops them under memory
        pressure, so RAM bounds the working set, not the model. Elsewhere: ordinary memory.
        """
        if self.swap is None or device.type != "cpu":
            return torch.zeros(numel, dtype=self.dtype, device=device)
        self.mapped_bytes += numel * self.dtype.itemsize
        self.swap.check_space(self.mapped_bytes)  # sparse files: they take disk space as they are written
        path = self.swap.file(f"{name}.swp")
        with open(path, "wb") as f:
            f.truncate(numel * self.dtype.itemsize)  # sparse: no disk blocks until written
        return torch.from_file(path, shared=True, size=numel, dtype=self.dtype)  # zeros: a fresh sparse file

    def _to_device(self, params: Chunks) -> Callable[[int, int, torch.Tensor], None]:
        def publish(k: int, lo: int, values: torch.Tensor) -> None:
            copy_in(params, values, lo)
            self.accelerator.synchronize()  # ``values`` (staging or a swap buffer) is reused next

        return publish

    # ------------------------------------------------------------------ per step
    @property
    def grad_scale(self) -> float:
        return self.optimizer.grad_scale

    @grad_scale.setter
    def grad_scale(self, value: float) -> None:
        self.optimizer.grad_scale = value

    def prepare_gradients(self) -> None:
        """The strategy's reduced gradients are final: start bringing them to CPU memory (CUDA)."""
        if self.grads is not None:
            # The copy runs while the device computes the gradient norm; step() waits for it.
            host, device_grads = self.grads.tensors[0], self._device_grads()
            self.copy = self.context.issue(
                "copy", lambda: copy_out(device_grads, host, 0), "offloaded gradients to host"
            )
        if isinstance(self.store, NVMeStateStore):
            self.store.prefetch_first()  # the first read overlaps with the norm and the clipping

    def use_gradients(self, used: list[bool]) -> None:
        """Arm the step with the gradients of the parameters ``used`` on any rank."""
        self.optimizer.prepare(self.grads or self._device_grads(), used)

    def _wait_for_gradients(self) -> None:
        if self.copy is not None:
            self.context.wait_host(self.copy)
            self.copy = None

    def zero_grad(self) -> None:
        self.optimizer.grad_scale = 1.0

    # ------------------------------------------------------------------ state
    def masters(self, lo: int, hi: int) -> torch.Tensor:
        """fp32 master values over ``[lo, hi)`` of the partition (a copy, in CPU memory)."""
        return self.store.read("master", lo, hi)

    def piece(self, name: str, offset: int, numel: int) -> torch.Tensor:
        """``name`` ("master", "exp_avg", "exp_avg_sq") over one piece: a writable view when the
        state is in CPU memory, a copy read from the swap files on NVMe (write it back with :meth:`write`)."""
        view = self.store.view(name, offset, numel)
        return view if view is not None else self.store.read(name, offset, offset + numel)

    def in_memory(self) -> bool:
        """Whether :meth:`piece` returns views (writes into them need no :meth:`write`)."""
        return isinstance(self.store, CPUStateStore)

    def write(self, name: str, offset: int, values: torch.Tensor) -> None:
        """Overwrite ``name`` from partition offset ``offset`` (to NVMe when it lives there)."""
        self.store.write(name, offset, values.to(torch.float32).reshape(-1))

    def segment_at(self, offset: int) -> Segment | None:
        """The optimizer's segment starting at partition ``offset`` (None: a frozen piece)."""
        return self.segment_of.get(offset)

    def step_count(self, param: int) -> int:
        return self.optimizer.steps[param]

    def set_step_count(self, param: int, step: int) -> None:
        self.optimizer.steps[param] = step

    def publish_masters(self) -> None:
        """Make the parameters (device, CPU or NVMe shards) show the masters; see OffloadAdam.publish_masters."""
        self.optimizer.publish_masters()

    def memory_bytes(self) -> int:
        grads = 0 if self.grads is None else self.numel * self.grads.tensors[0].element_size()
        staging = self.optimizer.staging
        return self.store.memory_bytes() + grads + (0 if staging is None else staging.numel() * staging.element_size())

    def close(self) -> None:
        self.store.close()
        if self.swap is not None:
            self.swap.remove()


def _hyperparameters(
    optimizer: torch.optim.Optimizer | OptimizerFactory, groups: list[ParamGroupSpec], index: dict[int, int]
) -> tuple[list[Any], dict[int, int]]:
    """Adam settings per optimizer group and the group of each trainable parameter.

    A user's optimizer instance keeps its own groups; a factory (the config's optimizer, or a
    user callable) is built once over stand-in tensors to read what it would have used.
    """
    if isinstance(optimizer, torch.optim.Optimizer):
        if optimizer.state:
            raise ConfigError("optimizer: already has state; pass a fresh optimizer so offload can own its state")
        member = [[p for p in g["params"] if id(p) in index] for g in optimizer.param_groups]
        hyper = adam_hyper(optimizer)
    else:
        kept = [g for g in groups if any(id(p) in index for p in g.params)]
        probe = optimizer([{**g.options, "params": [torch.zeros(1)]} for g in kept])
        hyper = adam_hyper(probe)
        member = [[p for p in g.params if id(p) in index] for g in kept]
    group_of = {index[id(p)]: gi for gi, params in enumerate(member) for p in params}
    return hyper, group_of
