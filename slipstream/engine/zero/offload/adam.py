"""Adam/AdamW over a rank's offloaded partition, stepped sub-group by sub-group on the CPU.

``OffloadAdam`` is a ``torch.optim.Optimizer`` so the engine, LR schedulers and users see the
usual ``param_groups`` (lr, betas, eps, weight_decay per group). Its "parameters" are
placeholders, one per piece this rank owns: the fp32 master views when the masters are in
memory, meta tensors when they are on NVMe. The real state is flat, in partition coordinates
(see chunks.py), held by a :class:`StateStore`; :meth:`OffloadAdam.partition_state` and
:meth:`OffloadAdam.load_partition_state` are the accessors for checkpoints.

Each sub-group is updated by one :func:`cpu_adam_step` call per (group, step count): gradients
are read in the model's dtype and multiplied by ``grad_scale`` (loss-scale unscale x clipping) as
they are read, and a bf16/fp16 model receives its rounded parameters in the same pass.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from slipstream.engine.config.base import ConfigError
from slipstream.engine.zero.offload.chunks import Chunks
from slipstream.engine.zero.offload.state_store import STATE_NAMES, StateStore
from slipstream.errors import UsageError
from slipstream.ops.adam import cpu_adam_step, evaluate_closure


@dataclasses.dataclass(frozen=True)
class Segment:
    """A piece of one trainable parameter inside this rank's partition."""

    offset: int
    numel: int
    group: int
    param: int  # index of the trainable parameter: step count and used flag


@dataclasses.dataclass(frozen=True)
class AdamHyper:
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    adamw_mode: bool


def adam_hyper(optimizer: torch.optim.Optimizer) -> list[AdamHyper]:
    """Each group's Adam settings from an optimizer built the usual way; ValueError if it is not Adam."""
    from slipstream.ops.adam import _Adam

    if isinstance(optimizer, _Adam):
        return [
            AdamHyper(g["lr"], tuple(g["betas"]), g["eps"], g["weight_decay"], g["adamw_mode"])
            for g in optimizer.param_groups
        ]
    if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW):
        out = []
        for g in optimizer.param_groups:
            if g.get("amsgrad") or g.get("maximize"):
                raise ConfigError(
                    "zero_optimization.offload_optimizer: amsgrad/maximize Adam cannot be offloaded; turn them off"
                )
            decoupled = type(optimizer) is torch.optim.AdamW or bool(g.get("decoupled_weight_decay", False))
            out.append(AdamHyper(float(g["lr"]), tuple(g["betas"]), g["eps"], g["weight_decay"], decoupled))
        return out
    raise ConfigError(
        f"zero_optimization.offload_optimizer: the offloaded optimizer is the CPU Adam, so the optimizer must be "
        f"Adam or AdamW (config optimizer.type, torch.optim.Adam/AdamW or slipstream.ops.adam.CPUAdam), got {type(optimizer).__name__}"
    )


class ParamSink:
    """Where updated parameters (model dtype) go after each sub-group.

    ``direct``: CPU tensors in partition coordinates that the Adam kernel writes into as it goes
    (the parameters of a CPU run, or ZeRO-3's CPU-resident shard). ``publish(lo, values)`` receives
    a sub-group's values instead when the parameters live elsewhere (device memory, NVMe);
    ``values`` is then the master itself (fp32 model) or a bf16/fp16 staging buffer.
    """

    def __init__(
        self,
        dtype: torch.dtype,
        direct: Chunks | None = None,
        publish: Callable[[int, int, torch.Tensor], None] | None = None,
        aliases_master: bool = False,
    ) -> None:
        self.dtype, self.direct, self.publish, self.aliases_master = dtype, direct, publish, aliases_master


class OffloadAdam(torch.optim.Optimizer):
    def __init__(
        self,
        placeholders: list[list[torch.Tensor]],
        hyper: list[AdamHyper],
        segments: list[Segment],
        store: StateStore,
        sink: ParamSink,
        num_params: int,
    ) -> None:
        groups = [
            {
                "params": ph,
                "lr": h.lr,
                "betas": h.betas,
                "eps": h.eps,
                "weight_decay": h.weight_decay,
                "adamw_mode": h.adamw_mode,
            }
            for ph, h in zip(placeholders, hyper)
        ]
        super().__init__(groups, {})
        self.segments, self.store, self.sink = segments, store, sink
        self.steps = [0] * num_params  # Adam step count per trainable parameter (unused ones do not advance)
        self.grads: Chunks | None = None
        self.used: list[bool] | None = None
        self.grad_scale = 1.0
        self.before_step: Callable[[], None] | None = None  # e.g. wait for the gradients' copy to CPU memory
        self.lowp = sink.dtype != torch.float32
        self.staging: torch.Tensor | None = None
        if self.lowp and sink.direct is None:
            largest = max((hi - lo for lo, hi in store.subgroups), default=0)
            self.staging = torch.zeros(largest, dtype=sink.dtype)
            if store.pinned:
                from slipstream.accelerator import get_accelerator

                self.staging = get_accelerator().pinned_empty(largest, sink.dtype).zero_()
        self.by_subgroup = [
            [s for s in segments if s.offset < hi and lo < s.offset + s.numel] for lo, hi in store.subgroups
        ]

    def prepare(self, grads: Chunks, used: list[bool]) -> None:
        """Gradients for the coming step (partition coordinates, CPU) and which parameters got one."""
        self.grads, self.used = grads, used

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = evaluate_closure(closure)
        if self.grads is None or self.used is None:
            raise UsageError("OffloadAdam.step: no gradients prepared; step through the engine (engine.step())")
        if self.before_step is not None:
            self.before_step()
        for k, (lo, hi) in enumerate(self.store.subgroups):
            state = self.store.acquire(k)
            self._step_subgroup(k, lo, hi, state)
            self.store.release(k)
        for i, used in enumerate(self.used):
            self.steps[i] += int(used)
        self.grads, self.used, self.grad_scale = None, None, 1.0
        return loss

    def _step_subgroup(self, k: int, lo: int, hi: int, state: dict[str, Chunks]) -> None:
        calls: dict[tuple[int, int], list[list[torch.Tensor]]] = {}
        assert self.grads is not None and self.used is not None
        master = state["master"]
        for s in self.by_subgroup[k]:
            a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
            out = self._lowp_out(a, b - a, lo)
            if not self.used[s.param]:
                if out is not None:  # keep the copy in step with the unchanged master
                    out.copy_(master.slice(a, b - a))
                continue
            lists = calls.setdefault((s.group, self.steps[s.param] + 1), [[], [], [], [], []])
            lists[0].append(master.slice(a, b - a))
            lists[1].append(self.grads.slice(a, b - a))
            lists[2].append(state["exp_avg"].slice(a, b - a))
            lists[3].append(state["exp_avg_sq"].slice(a, b - a))
            if out is not None:
                lists[4].append(out)
        for (group, step), (params, grads, exp_avgs, exp_avg_sqs, outs) in calls.items():
            g = self.param_groups[group]
            cpu_adam_step(
                params,
                grads,
                exp_avgs,
                exp_avg_sqs,
                step=step,
                lr=g["lr"],
                beta1=g["betas"][0],
                beta2=g["betas"][1],
                eps=g["eps"],
                weight_decay=g["weight_decay"],
                adamw_mode=g["adamw_mode"],
                grad_scale=self.grad_scale,
                out_lowp=outs or None,
            )
        self._publish(k, lo, hi, master)

    def _lowp_out(self, start: int, numel: int, lo: int) -> torch.Tensor | None:
        if not self.lowp:
            return None
        if self.sink.direct is not None:
            return self.sink.direct.slice(start, numel)
        assert self.staging is not None
        return self.staging[start - lo : start - lo + numel]

    def _publish(self, k: int, lo: int, hi: int, master: Chunks) -> None:
        sink = self.sink
        if self.lowp:
            if sink.publish is not None:
                assert self.staging is not None
                sink.publish(k, lo, self.staging[: hi - lo])
            return
        if sink.aliases_master:
            return
        if sink.direct is not None:  # fp32 params in CPU memory that are not the masters (NVMe optimizer)
            for s in self.by_subgroup[k]:
                a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
                sink.direct.slice(a, b - a).copy_(master.slice(a, b - a))
        if sink.publish is not None:
            sink.publish(
                k,
                lo,
                master.tensors[0][: hi - lo]
                if len(master.tensors) == 1 and master.offsets[0] == lo
                else _gather(master, lo, hi),
            )

    # ------------------------------------------------------------------ state accessors
    def partition_state(self) -> dict[str, Any]:
        """This rank's optimizer state, flat in partition coordinates: ``master``, ``exp_avg``,
        ``exp_avg_sq`` (fp32 CPU tensors of the partition's length; padding included) and
        ``steps`` (per trainable parameter). Reads from NVMe when the state lives there."""
        numel = self.store.subgroups[-1][1] if self.store.subgroups else 0
        state: dict[str, Any] = {name: self.store.read(name, 0, numel) for name in STATE_NAMES}
        state["steps"] = list(self.steps)
        return state

    def load_partition_state(self, state: dict[str, Any]) -> None:
        """Inverse of :meth:`partition_state` (same partition layout); the model's parameters are
        not touched: the caller loads them (or runs a step) separately."""
        for name in STATE_NAMES:
            self.store.write(name, 0, state[name].to(torch.float32).reshape(-1))
        if len(state["steps"]) != len(self.steps):
            raise ValueError(
                f"OffloadAdam: steps for {len(state['steps'])} parameters, this partition has {len(self.steps)}"
            )
        self.steps = [int(s) for s in state["steps"]]

    def publish_masters(self) -> None:
        """Push every master (e.g. just loaded from a checkpoint) to the parameters, sub-group by
        sub-group, through the sink the step uses: frozen pieces and padding included."""
        if self.sink.aliases_master:
            return  # the masters are the parameters
        from slipstream.engine.zero.offload.chunks import copy_in

        for k, (lo, hi) in enumerate(self.store.subgroups):
            values = self.store.read("master", lo, hi).to(self.sink.dtype)
            if self.sink.direct is not None:
                copy_in(self.sink.direct, values, lo)
            if self.sink.publish is not None:
                self.sink.publish(k, lo, values)

    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        out["partition_state"] = self.partition_state()
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        partition = state_dict.pop("partition_state", None)
        super().load_state_dict(state_dict)
        if partition is not None:
            self.load_partition_state(partition)


def _gather(chunks: Chunks, lo: int, hi: int) -> torch.Tensor:
    from slipstream.engine.zero.offload.chunks import copy_out

    out = torch.zeros(hi - lo, dtype=chunks.dtype)
    copy_out(chunks, out, lo)
    return out
