"""Putting a checkpoint back into a :class:`CheckpointTarget` of any world size, stage or layout.

[Note: all or nothing] A load first reads, decodes and validates everything this rank will apply
(weights, optimizer state and groups, scheduler, loss scaler, counters, RNG, loader and registered
objects); only then does it change anything. The cheap ``Stateful`` pieces are applied first with
their previous state kept aside, so a ``load_state_dict`` that raises puts them all back; the
weights and optimizer state, already checked against the model, are written last. A failed load
therefore leaves the engine exactly as it was.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import torch

from slipstream.comm import all_gather_objects
from slipstream.engine.checkpoint.capture import LOADER_STATE, persistent_buffers
from slipstream.engine.checkpoint.reader import CheckpointError, CheckpointReader
from slipstream.engine.checkpoint.target import CheckpointTarget, TrainState
from slipstream.engine.zero.slices import OwnedSlice
from slipstream.utils.logging import get_logger
from slipstream.utils.pieces import ParamSlice

logger = get_logger(__name__)


@dataclasses.dataclass
class _Decoded:
    """Everything one rank applies, read and checked."""

    values: dict[ParamSlice, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    states: dict[ParamSlice, dict[str, Any] | None] | None  # None: optimizer state not loaded
    groups: list[dict[str, Any]] | None
    stateful: list[tuple[str, Any, Any]]  # (what, object, state) in the order they are applied
    client: dict[str, Any]


def restore(
    target: CheckpointTarget,
    reader: CheckpointReader,
    rank: int,
    *,
    strict: bool,
    optimizer: bool,
    scheduler: bool,
    module_only: bool,
    agree: Any = None,
) -> dict[str, Any]:
    """Load ``reader``'s checkpoint into ``target``; returns the client state. Collective.

    Everything is read first (``agree`` runs that on every rank and raises everywhere if any rank
    fails, e.g. on a corrupt file only it reads), then applied: no rank is left in a collective.
    """
    owned = target.shards.sharded_state()
    model_names = _model_names(target) if target.spread else None

    def read_all() -> _Decoded:
        return _read(
            target,
            reader,
            rank,
            owned,
            strict=strict,
            optimizer=optimizer and not module_only,
            scheduler=scheduler,
            module_only=module_only,
            model_names=model_names,
        )

    decoded = agree(read_all, "reading the checkpoint") if agree is not None else read_all()
    apply_stateful(decoded.stateful, reader.path)
    if decoded.groups is not None:
        _apply_groups(target.optimizer, decoded.groups)
    target.shards.load_sharded_state(decoded.values.__getitem__)
    with torch.no_grad():
        for name, buf in persistent_buffers(target.module).items():
            if name in decoded.buffers:
                buf.copy_(decoded.buffers[name])
    if decoded.states is not None:
        _apply_slice_states(target, owned, decoded.states)
    return decoded.client


# --------------------------------------------------------------------------- read and check


def _model_names(target: CheckpointTarget) -> set[str]:
    """The parameter names of the whole spread model (a pipeline stage holds only its own). Collective."""
    every = all_gather_objects([n for n, _ in target.module.named_parameters()])
    return {n for names in every for n in names}


def _read(
    target: CheckpointTarget,
    reader: CheckpointReader,
    rank: int,
    owned: list[OwnedSlice],
    *,
    strict: bool,
    optimizer: bool,
    scheduler: bool,
    module_only: bool,
    model_names: set[str] | None = None,
) -> _Decoded:
    reader.check_model(target.module, strict=strict, model_names=model_names)
    saved = reader.manifest["parameters"]  # a frozen parameter left out (non-strict load) keeps its value
    values = {o.slice: reader.read_param(o.slice) if o.slice.name in saved else o.value.detach().clone() for o in owned}
    common = reader.common()
    buffers = {}
    ours = persistent_buffers(target.module)
    for name, key in common["buffers"].items():
        value = reader.tensor(0, key)
        if name in ours and tuple(value.shape) != tuple(ours[name].shape):
            raise CheckpointError(
                f"checkpoint {reader.path}: buffer {name!r} has shape {tuple(value.shape)} in the checkpoint but "
                f"{tuple(ours[name].shape)} in the model (a different model or model config?)"
            )
        buffers[name] = value
    if module_only:
        return _Decoded(values, buffers, None, None, [], {})
    states, groups = None, None
    if optimizer:
        states = {
            o.slice: _check_state(reader, o, reader.read_optimizer_state(o.slice))
            for o in owned
            if o.optimizer_param is not None
        }
        groups = _check_groups(reader, target.optimizer, reader.decode(0, common["optimizer_groups"]))
    stateful: list[tuple[str, Any, Any]] = []
    if scheduler and target.scheduler is not None and common["lr_scheduler"] is not None:
        stateful.append(("lr_scheduler", target.scheduler, reader.decode(0, common["lr_scheduler"])))
    scaler = reader.decode(0, common["loss_scaler"])
    current = target.loss_scaler.state_dict()
    if isinstance(scaler, dict) and set(scaler) == set(current):
        stateful.append(("loss scaler", target.loss_scaler, scaler))
    elif current:  # e.g. an fp32 or bf16 checkpoint into an fp16 engine: no scale was saved
        logger.info(
            "checkpoint %s was saved as %s: the loss scaler keeps its initial state",
            reader.path,
            reader.manifest["precision"],
        )
    stateful.append(
        ("counters", target.counters, dataclasses.asdict(counters_from(reader.path, common["counters"], target)))
    )
    stateful.extend(_per_rank(target, reader, rank))
    return _Decoded(values, buffers, states, groups, stateful, reader.decode(0, common["client_state"]))


def counters_from(where: Path, saved: Any, target: CheckpointTarget) -> TrainState:
    """The saved counters, checked, with the micro-step count re-expressed in the target's accumulation windows."""
    fields = [f.name for f in dataclasses.fields(TrainState)]
    if not isinstance(saved, dict) or any(type(saved.get(f)) is not int or saved[f] < 0 for f in fields):
        raise CheckpointError(
            f"checkpoint {where}: the saved counters are {saved!r}; expected non-negative integers "
            f"{', '.join(fields)} (the file is damaged: load another checkpoint)"
        )
    now = target.counters.record().gradient_accumulation_steps
    # Micro-steps count accumulation windows of the *current* size: another world size may mean another gas.
    into_window = saved["micro_steps"] - saved["global_steps"] * saved["gradient_accumulation_steps"]
    return TrainState(
        global_steps=saved["global_steps"],
        micro_steps=saved["global_steps"] * now + into_window,
        global_samples=saved["global_samples"],
        skipped_steps=saved["skipped_steps"],
        gradient_accumulation_steps=now,
    )


def _check_groups(reader: CheckpointReader, opt: torch.optim.Optimizer, groups: Any) -> list[dict[str, Any]]:
    """The saved groups' hyperparameters, checked, one per group of ``opt``.

    [Note: groups that differ only in sharding] Expert parallelism splits each parameter group into
    its dense and its expert part (sharded over different groups), so the same optimizer has one
    group at ep 1 and two at ep 2. When every saved group and every current group carry the same
    hyperparameters, the counts may differ: each current group gets them.
    """
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise CheckpointError(
            f"checkpoint {reader.path}: common.optimizer_groups is not a list of dicts (the file is damaged)"
        )
    current = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    if (
        len(groups) != len(current)
        and groups
        and all(same_values(g, groups[0]) for g in groups)
        and all(same_values(c, current[0]) for c in current)
    ):
        groups = [groups[0]] * len(current)
    if len(groups) != len(opt.param_groups):
        raise CheckpointError(
            f"checkpoint {reader.path}: the optimizer had {len(groups)} parameter group(s), this one has "
            f"{len(opt.param_groups)}; build the optimizer with the same groups, or load with load_optimizer_states=False"
        )
    for i, (group, saved) in enumerate(zip(opt.param_groups, groups)):
        for key, value in saved.items():
            current = group.get(key)
            if isinstance(current, tuple) and not (
                isinstance(value, (list, tuple)) and len(value) == len(current) and all(finite(v) for v in value)
            ):
                raise CheckpointError(
                    f"checkpoint {reader.path}: optimizer group {i} {key!r} is {value!r}, expected {len(current)} finite numbers "
                    "(the file is damaged: load another checkpoint, or load with load_optimizer_states=False)"
                )
            numeric = torch.is_tensor(current) or (isinstance(current, (int, float)) and not isinstance(current, bool))
            if numeric:
                if torch.is_tensor(value) and value.numel() == 1:
                    value = value.item()
                if not finite(value):
                    raise CheckpointError(
                        f"checkpoint {reader.path}: optimizer group {i} {key!r} is {value!r}, expected a finite number "
                        "(the file is damaged: load another checkpoint, or load with load_optimizer_states=False)"
                    )
    return groups


def same_values(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two hyperparameter dicts are equal; tensor-valued ones that cannot be compared this way are not."""
    try:
        return bool(a == b)
    except (RuntimeError, TypeError):  # tensor-valued hyperparameters: not comparable this way
        return False


def finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_state(
    reader: CheckpointReader, o: OwnedSlice, state: dict[str, tuple[str, Any]] | None
) -> dict[str, Any] | None:
    """The optimizer state of one slice, moved to its parameter's device and shape; numel checked."""
    if state is None:
        return None
    param = o.optimizer_param
    assert param is not None
    restored = {}
    for key, (kind, value) in state.items():
        if kind == "slice":
            if value.numel() != param.numel():
                raise CheckpointError(
                    f"checkpoint {reader.path}: optimizer state {key!r} of {o.slice.name!r} has {value.numel()} elements, "
                    f"the slice {param.numel()} (the file is damaged)"
                )
            restored[key] = value.to(param.device).reshape(param.shape)
        elif kind == "tensor":  # a scalar such as torch Adam's step: on the parameter's device only if it was
            tensor, on_param = value
            restored[key] = tensor.to(param.device if on_param else "cpu")
        else:
            restored[key] = value
    return restored


def _per_rank(target: CheckpointTarget, reader: CheckpointReader, rank: int) -> list[tuple[str, Any, Any]]:
    same_world = reader.world_size == target.world_size
    source = rank if rank < reader.world_size else None
    found: list[tuple[str, Any, Any]] = []
    if source is not None and not reader.rank_meta(source)["rng"]:  # converted from DeepSpeed, which saves none
        logger.info("checkpoint %s holds no RNG state; the random generators keep their current state", reader.path)
    elif source is not None:
        found.append(("RNG state", target.rng, reader.decode(source, reader.rank_meta(source)["rng"])))
        if not same_world:
            logger.info("checkpoint saved by %d ranks: this rank takes rank %d's RNG state", reader.world_size, source)
    else:
        logger.warning(
            "checkpoint saved by %d ranks has no RNG state for rank %d; keeping the current one",
            reader.world_size,
            rank,
        )
    for name, obj in target.extra.items():
        # The engine's loader position is global (any rank's will do); other objects' state is per rank.
        src = next((r for r in (source, 0) if r is not None and name in reader.rank_meta(r)["stateful"]), None)
        if src is None:
            if "source" in reader.manifest:  # converted from DeepSpeed, which saves only its own engine's state
                logger.info(
                    "%s checkpoint %s carries no state for %r; it keeps its current state (a host integration "
                    "restores its own files)",
                    reader.manifest["source"].get("format", "foreign"),
                    reader.path,
                    name,
                )
            else:
                logger.warning("checkpoint %s holds no state for %r; it starts fresh", reader.path, name)
            continue
        if name != LOADER_STATE and src != rank:
            logger.warning("checkpoint saved by %d ranks: %r takes rank %d's state", reader.world_size, name, src)
        found.append((name, obj, reader.decode(src, reader.rank_meta(src)["stateful"][name])))
    return found


# --------------------------------------------------------------------------- apply


def apply_stateful(pieces: list[tuple[str, Any, Any]], where: Path) -> None:
    """``load_state_dict`` each piece; if one fails, put every piece back as it was."""
    previous = [(obj, obj.state_dict()) for _, obj, _ in pieces]
    for i, (what, obj, state) in enumerate(pieces):
        try:
            obj.load_state_dict(state)
        except Exception as err:  # noqa: BLE001 - rolled back and reported as the checkpoint's fault
            for prev_obj, prev_state in previous[: i + 1]:
                try:
                    prev_obj.load_state_dict(prev_state)
                except Exception:  # noqa: BLE001, S110 - the failing one may refuse its own state too
                    pass
            raise CheckpointError(
                f"checkpoint {where}: {what}.load_state_dict() refused the saved state ({type(err).__name__}: {err}); "
                "nothing was loaded"
            ) from None


def _apply_groups(opt: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> None:
    for group, saved in zip(opt.param_groups, groups):
        apply_group(group, saved)


def apply_group(group: dict[str, Any], saved: dict[str, Any]) -> None:
    """Set one optimizer group's hyperparameters to checked saved values (a tensor-valued one in place)."""
    for key, value in saved.items():
        current = group.get(key)
        if torch.is_tensor(current):
            current.fill_(value if not torch.is_tensor(value) else value.item())
        elif isinstance(current, tuple) and isinstance(value, list):
            group[key] = tuple(value)
        else:
            group[key] = value


def _apply_slice_states(target: CheckpointTarget, owned: list[OwnedSlice], states: dict[ParamSlice, Any]) -> None:
    for o in owned:
        if o.optimizer_param is not None:
            target.shards.load_slice_optimizer_state(o, states[o.slice])
