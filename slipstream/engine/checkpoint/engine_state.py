"""What one rank saves of an engine, and how it is put back.

:func:`capture` runs on the training thread at a step boundary and returns a :class:`Payload`:
the tensors to write (live references; see snapshot.py for background writes) and the JSON
metadata. :func:`restore` applies a :class:`CheckpointReader` to an engine of any world size or
ZeRO stage: weights and optimizer state by parameter slice, the rest by name.
"""

from __future__ import annotations

import dataclasses
import random
import time
from typing import TYPE_CHECKING, Any

import torch

from slipstream.engine.checkpoint.format import FORMAT_NAME, FORMAT_VERSION, encode_tree
from slipstream.engine.zero.slices import OwnedSlice, ParamSlice
from slipstream.utils.logging import get_logger
from slipstream.version import __version__

if TYPE_CHECKING:
    from slipstream.engine.checkpoint.reader import CheckpointReader
    from slipstream.engine.engine import Engine
    from slipstream.engine.zero.strategy import ShardingStrategy

logger = get_logger(__name__)

LOADER_STATE = "training_dataloader"


@dataclasses.dataclass
class Payload:
    """One rank's part of a checkpoint: ``tensors`` go to ``rankNNNNN.safetensors``, ``meta`` to its JSON."""

    rank: int
    tensors: Any  # dict[str, Tensor] of live tensors, or a GuardedTensors for a background write
    meta: dict[str, Any]
    manifest: dict[str, Any] | None = None  # rank 0: everything of the manifest but the file list
    config: dict[str, Any] | None = None  # rank 0


def stateful_objects(engine: Engine) -> dict[str, Any]:
    """Objects saved through their own ``state_dict()``/``load_state_dict()``: the loader and registered ones."""
    objects = {}
    loader = engine.training_dataloader
    if loader is not None and hasattr(loader, "state_dict") and hasattr(loader, "load_state_dict"):
        objects[LOADER_STATE] = loader
    objects.update(engine.checkpoint_states)
    return objects


def capture(
    engine: Engine, rank: int, world: int, tag: str, client_state: dict[str, Any] | None, exclude_frozen: bool = False
) -> Payload:
    tensors: dict[str, torch.Tensor] = {}
    slices = []
    frozen = {n for n, p in engine.module.named_parameters() if not p.requires_grad} if exclude_frozen else set()
    for owned in engine.strategy.sharded_state():
        if (owned.replicated and rank != 0) or owned.slice.name in frozen:  # exclude_frozen_parameters (issue 15)
            continue
        slices.append(_capture_slice(owned, engine.strategy.slice_optimizer_state(owned), tensors))
    meta: dict[str, Any] = {"rank": rank, "world_size": world, "slices": slices}
    meta["rng"] = encode_tree(_rng_state(engine), "rng", tensors, "RNG state")
    meta["stateful"] = {
        name: encode_tree(obj.state_dict(), f"stateful/{name}", tensors, f"{name}.state_dict()")
        for name, obj in stateful_objects(engine).items()
    }
    payload = Payload(rank, tensors, meta)
    if rank == 0:
        meta["common"] = _capture_common(engine, client_state, tensors)
        payload.manifest = _manifest_body(engine, world, tag)
        if frozen:  # the manifest lists exactly what the files hold (issue 15)
            payload.manifest["parameters"] = {n: v for n, v in payload.manifest["parameters"].items() if n not in frozen}
            keys = payload.manifest["state_dict_keys"]
            payload.manifest["state_dict_keys"] = {k: v for k, v in keys.items() if v.get("param") not in frozen}
        payload.config = engine.config.model_dump(mode="json", by_alias=False, exclude_unset=True)
    return payload


def _capture_slice(owned: OwnedSlice, state: dict[str, Any] | None, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    s = owned.slice
    key = f"p/{s.name}/{s.start}"
    tensors[key] = owned.value if owned.value.dtype == torch.float32 else owned.value.float()
    entry: dict[str, Any] = {"name": s.name, "shape": list(s.shape), "start": s.start, "numel": s.numel, "key": key}
    if state:
        entry["optimizer"] = opt = {}
        for name, value in state.items():
            okey = f"o/{s.name}/{s.start}/{name}"
            if torch.is_tensor(value) and value.numel() == s.numel and value.dim() > 0:
                tensors[okey] = value.detach().reshape(-1)
                opt[name] = {"slice": okey}
            elif torch.is_tensor(value):
                tensors[okey] = value.detach()
                on_param = value.device == owned.optimizer_param.device  # type: ignore[union-attr]
                opt[name] = {"tensor": okey, "on_param_device": on_param}
            else:
                opt[name] = {"value": encode_tree(value, okey, tensors, f"optimizer state {name!r} of {s.name}")}
    return entry


# fmt: off
def _capture_common(engine: Engine, client_state: dict[str, Any] | None, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """State every rank shares (saved once, by rank 0)."""
    groups = [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups]
    scheduler = engine.lr_scheduler
    buffers = {}
    for name, buf in persistent_buffers(engine.module).items():
        buffers[name] = f"b/{name}"
        tensors[f"b/{name}"] = buf.detach()
    return {
        "counters": {
            "global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
            "global_samples": engine.global_samples, "skipped_steps": engine.skipped_steps,
            "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
        },
        "optimizer_groups": encode_tree(groups, "common/optimizer_groups", tensors, "optimizer.param_groups"),
        "lr_scheduler": None if scheduler is None or not hasattr(scheduler, "state_dict")
        else encode_tree(scheduler.state_dict(), "common/lr_scheduler", tensors, "lr_scheduler.state_dict()"),
        "loss_scaler": encode_tree(engine.loss_scaler.state_dict(), "common/loss_scaler", tensors, "loss scaler"),
        "client_state": encode_tree(client_state or {}, "common/client_state", tensors, "client_state"),
        "buffers": buffers,
    }
# fmt: on


def _manifest_body(engine: Engine, world: int, tag: str) -> dict[str, Any]:
    module = engine.module
    names = {id(p): n for n, p in module.named_parameters()}
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "tag": tag,
        "created": time.time(),
        "slipstream_version": __version__,
        "torch_version": torch.__version__,
        "world_size": world,
        "zero_stage": engine.config.zero_optimization.stage,
        "precision": engine.config.precision,
        "global_steps": engine.global_steps,
        "micro_steps": engine.micro_steps,
        "module_class": f"{type(module).__module__}.{type(module).__qualname__}",
        "parameters": {
            n: {"shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch."), "trainable": n in trainable}
            for n, p in module.named_parameters()
        },
        "buffers": {
            n: {"shape": list(b.shape), "dtype": str(b.dtype).removeprefix("torch.")} for n, b in persistent_buffers(module).items()
        },
        "state_dict_keys": state_dict_keys(module, names),
    }


def persistent_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The buffers ``module.state_dict()`` holds, by their first name."""
    found: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for prefix, m in module.named_modules():
        for name, buf in m._buffers.items():
            if buf is not None and name not in m._non_persistent_buffers_set and id(buf) not in seen:
                seen.add(id(buf))
                found[f"{prefix}.{name}" if prefix else name] = buf
    return found


def state_dict_keys(module: torch.nn.Module, param_names: dict[int, str]) -> dict[str, dict[str, str]]:
    """Every key of ``module.state_dict()`` in its order, mapped to the parameter or buffer it holds.

    Tied weights appear under each of their names (as in ``state_dict()``), all pointing at the one
    name ``named_parameters()`` gives; export writes a copy under each key.
    """
    buffer_names = {id(b): n for n, b in persistent_buffers(module).items()}
    keys: dict[str, dict[str, str]] = {}
    for prefix, m in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for name, p in m._parameters.items():
            if p is not None:
                keys[dot + name] = {"param": param_names[id(p)]}
        for name, buf in m._buffers.items():
            if buf is not None and name not in m._non_persistent_buffers_set:
                keys[dot + name] = {"buffer": buffer_names[id(buf)]}
    return keys


def _rng_state(engine: Engine) -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"python": [version, list(internal), gauss], "torch": torch.get_rng_state()}
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy is optional
        numpy = None
    if numpy is not None:
        name, keys, pos, has_gauss, cached = numpy.random.get_state()
        state["numpy"] = [name, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached]
    device = engine.accelerator.rng_state()
    if device is not None:
        state["device"] = device
    return state


# --------------------------------------------------------------------------- restore


def restore(
    engine: Engine, reader: CheckpointReader, rank: int, *, strict: bool, optimizer: bool, scheduler: bool, module_only: bool,
    agree: Any = None,
) -> dict[str, Any]:
    """Load ``reader``'s checkpoint into ``engine``; returns the client state. Collective.

    Everything is read first (``agree`` runs that on every rank and raises everywhere if any rank
    fails, e.g. on a corrupt file only it reads), then applied: no rank is left in a collective.
    """
    owned = engine.strategy.sharded_state()

    def read_all() -> tuple[dict[ParamSlice, torch.Tensor], dict[ParamSlice, Any], dict[str, Any]]:
        reader.check_model(engine.module, strict=strict)
        values = {o.slice: reader.read_param(o.slice) for o in owned}
        states = {}
        if optimizer and not module_only:
            states = {o.slice: reader.read_optimizer_state(o.slice) for o in owned if o.optimizer_param is not None}
        common = reader.common()
        decoded = {
            "buffers": {name: reader.tensor(0, key) for name, key in common["buffers"].items()},
            "groups": reader.decode(0, common["optimizer_groups"]),
            "scheduler": None if common["lr_scheduler"] is None else reader.decode(0, common["lr_scheduler"]),
            "scaler": reader.decode(0, common["loss_scaler"]),
            "client": reader.decode(0, common["client_state"]),
            "counters": common["counters"],
        }
        return values, states, decoded

    values, states, common = agree(read_all, "reading the checkpoint") if agree is not None else read_all()
    engine.strategy.load_sharded_state(values.__getitem__)
    with torch.no_grad():
        for name, buf in persistent_buffers(engine.module).items():
            if name in common["buffers"]:
                buf.copy_(common["buffers"][name])
    if module_only:
        return {}
    if optimizer:
        _restore_optimizer(engine.strategy, owned, states, common["groups"], reader)
    if scheduler and engine.lr_scheduler is not None and common["scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(common["scheduler"])
    engine.loss_scaler.load_state_dict(common["scaler"])
    counters = common["counters"]
    engine.global_steps = counters["global_steps"]
    # Micro-steps count accumulation windows of the *current* size: another world size may mean another gas.
    into_window = counters["micro_steps"] - counters["global_steps"] * counters["gradient_accumulation_steps"]
    engine.micro_steps = engine.global_steps * engine.gradient_accumulation_steps() + into_window
    engine.global_samples, engine.skipped_steps = counters["global_samples"], counters["skipped_steps"]
    _restore_per_rank(engine, reader, rank)
    return common["client"]


def _restore_optimizer(
    strategy: ShardingStrategy, owned: list[OwnedSlice], states: dict[ParamSlice, Any], groups: list[dict[str, Any]],
    reader: CheckpointReader,
) -> None:  # fmt: skip
    opt = strategy.optimizer
    if len(groups) != len(opt.param_groups):
        raise ValueError(
            f"checkpoint {reader.path}: the optimizer had {len(groups)} parameter group(s), this one has "
            f"{len(opt.param_groups)}; build the optimizer with the same groups, or load with load_optimizer_states=False"
        )
    for group, saved in zip(opt.param_groups, groups):
        for key, value in saved.items():
            current = group.get(key)
            if torch.is_tensor(current):
                current.fill_(value if not torch.is_tensor(value) else value.item())
            elif isinstance(current, tuple) and isinstance(value, list):
                group[key] = tuple(value)
            else:
                group[key] = value
    for o in owned:
        if o.optimizer_param is None:
            continue
        state = states[o.slice]
        param = o.optimizer_param
        if state is None:
            strategy.load_slice_optimizer_state(o, None)
            continue
        restored = {}
        for key, (kind, value) in state.items():
            if kind == "slice":
                restored[key] = value.to(param.device).reshape(param.shape)
            elif kind == "tensor":  # a scalar such as torch Adam's step: on the parameter's device only if it was
                tensor, on_param = value
                restored[key] = tensor.to(param.device if on_param else "cpu")
            else:
                restored[key] = value
        strategy.load_slice_optimizer_state(o, restored)


def _restore_per_rank(engine: Engine, reader: CheckpointReader, rank: int) -> None:
    same_world = reader.world_size == engine.world_size
    source = rank if rank < reader.world_size else None
    if source is not None:
        _set_rng_state(engine, reader.decode(source, reader.rank_meta(source)["rng"]))
        if not same_world:
            logger.info("checkpoint saved by %d ranks: this rank takes rank %d's RNG state", reader.world_size, source)
    else:
        logger.warning("checkpoint saved by %d ranks has no RNG state for rank %d; keeping the current one", reader.world_size, rank)
    for name, obj in stateful_objects(engine).items():
        # The engine's loader position is global (any rank's will do); other objects' state is per rank.
        src = next((r for r in (source, 0) if r is not None and name in reader.rank_meta(r)["stateful"]), None)
        if src is None:
            logger.warning("checkpoint %s holds no state for %r; it starts fresh", reader.path, name)
            continue
        if name != LOADER_STATE and src != rank:
            logger.warning("checkpoint saved by %d ranks: %r takes rank %d's state", reader.world_size, name, src)
        obj.load_state_dict(reader.decode(src, reader.rank_meta(src)["stateful"][name]))


def _set_rng_state(engine: Engine, state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy

        name, keys, pos, has_gauss, cached = state["numpy"]
        numpy.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, cached))
    if "device" in state:
        engine.accelerator.set_rng_state(state["device"])


__all__ = ["ParamSlice", "Payload", "capture", "persistent_buffers", "restore", "state_dict_keys"]
