"""Save and load ``torch.distributed.checkpoint`` (DCP) checkpoints laid out as FSDP2 keeps them.

[Note: the DCP layout] An FSDP2 job saves ``{"model": model_sd, "optimizer": optim_sd}`` with
``model_sd, optim_sd = get_state_dict(model, optimizer)``; DCP flattens the nesting into keys joined
by dots. So this module writes and reads::

    model.<state_dict key>                       every parameter (fp32 masters) and persistent buffer
    optimizer.state.<fqn>.<name>                 exp_avg / exp_avg_sq (the parameter's shape), step (0-dim)
    optimizer.param_groups.<i>.<hyperparameter>  lr, betas, ..., and params: the group's fqns
    slipstream.{counters,lr_scheduler,loss_scaler}.{tree,tensors.*}   our extras (JSON + tensors)

and an FSDP2 job continues from it with ``dcp.load`` + ``set_state_dict``. Loading also accepts
torchtitan's variant (model keys without the ``model.`` prefix, param groups flattened per fqn as
``optimizer.param_groups.<fqn>.<hyperparameter>``) and checkpoints saved at any world size.

[Note: flat ranges as DCP chunks] A ZeRO rank owns a flat range of each flattened parameter, not a
dim-0 chunk. DCP's metadata describes a tensor as boxes (offsets, sizes) that tile it, any number
per rank, and a flat range of a row-major tensor is a few such boxes: a partial first row, a block
of whole rows, a partial last row (recursively in higher dimensions). So each rank writes its own
ranges as boxes with no communication and no gather, through a planner that adds them to DCP's
plan. Loading asks DCP for the rows that cover each owned range (at most two rows more than the
range) and cuts the range out, whatever chunks the checkpoint was written in: memory stays within
this rank's share plus a few rows.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from slipstream.comm import all_gather_objects
from slipstream.engine.checkpoint.agree import agree
from slipstream.engine.checkpoint.capture import persistent_buffers, state_dict_keys
from slipstream.engine.checkpoint.format import decode_tree, encode_tree
from slipstream.engine.checkpoint.restore import apply_group, apply_stateful, counters_from, finite, same_values
from slipstream.engine.checkpoint.target import CheckpointTarget
from slipstream.engine.checkpoint.validate import CheckpointError
from slipstream.engine.zero.slices import OwnedSlice
from slipstream.utils.logging import get_logger
from slipstream.utils.pieces import Box, ParamSlice, flat_boxes
from slipstream.utils.placement import global_shape_and_box

logger = get_logger(__name__)

MODEL, STATE, GROUPS, EXTRA = "model.", "optimizer.state.", "optimizer.param_groups.", "slipstream."
# Group entries that choose an implementation rather than the mathematics: a load keeps ours.
IMPLEMENTATION = frozenset({"params", "foreach", "fused", "capturable", "differentiable"})
# What torch's Adam/AdamW hold in a group beyond lr, betas, eps, weight_decay: our Adams (adamw_mode) are saved like them.
TORCH_ADAM = {
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": None,
}


class _SavePlanner(DefaultSavePlanner):
    """DCP's default planner plus this rank's boxes: ``pieces[key] = (global shape, {offsets: tensor})``."""

    def __init__(self, pieces: dict[str, tuple[tuple[int, ...], dict[tuple[int, ...], torch.Tensor]]]) -> None:
        super().__init__()
        self.pieces = pieces

    def set_up_planner(
        self, state_dict: Any, storage_meta: StorageMeta | None = None, is_coordinator: bool = False
    ) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        for key in self.pieces:  # recorded as if nested: tools that rebuild the state dict see FSDP2's shape
            head, _, rest = key.partition(".")
            self.mappings[key] = (
                (head, "state", *rest[len("state.") :].rsplit(".", 1)) if key.startswith(STATE) else (head, rest)
            )

    def create_local_plan(self) -> Any:
        plan = super().create_local_plan()
        items = [
            WriteItem(
                index=MetadataIndex(key, torch.Size(offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(torch.Size(offsets), tensor.shape),
                    properties=TensorProperties.create_from_tensor(tensor),
                    size=torch.Size(shape),
                ),
            )
            for key, (shape, boxes) in self.pieces.items()
            for offsets, tensor in boxes.items()
        ]
        self.plan = dataclasses.replace(plan, items=[*plan.items, *items])
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        entry = self.pieces.get(write_item.index.fqn)
        if entry is None:
            return super().resolve_data(write_item)
        return entry[1][tuple(write_item.index.offset)]


class _LoadPlanner(DefaultLoadPlanner):
    """DCP's default planner over a flat dict, plus boxes to fill: ``boxes[key] = [(box, tensor)]``.

    Bytes are unpickled with ``weights_only=True`` (DCP's default allows any object).
    """

    def __init__(self, boxes: dict[str, list[tuple[Box, torch.Tensor]]]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.boxes = boxes

    def create_local_plan(self) -> Any:
        plan = super().create_local_plan()
        assert self.metadata is not None
        items = list(plan.items)
        for key, wanted in self.boxes.items():
            chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for (o, s), _ in wanted]
            items += create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], chunks)
        return dataclasses.replace(plan, items=items)

    def resolve_tensor(self, read_item: Any) -> torch.Tensor:
        wanted = self.boxes.get(read_item.dest_index.fqn)
        if wanted is None:
            return super().resolve_tensor(read_item)
        tensor = wanted[read_item.dest_index.index][1]
        for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            tensor = tensor.narrow(dim, offset, length)
        return tensor

    def load_bytes(self, read_item: Any, value: Any) -> None:
        self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


_METADATA_TYPES = {
    "ChunkStorageMetadata",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "Metadata",
    "MetadataIndex",
    "TensorProperties",
    "StorageMeta",
    "_MEM_FORMAT_ENCODING",
    "MEM_FORMAT_ENCODING",
}
_SAFE_GLOBALS = {
    "torch.distributed.checkpoint.metadata": _METADATA_TYPES,
    "torch.distributed._shard.sharded_tensor.metadata": _METADATA_TYPES,  # where older torch kept TensorProperties
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _SafeUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` is a pickle: only its own record types, torch dtypes and paths are let through."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _SAFE_GLOBALS.get(module, ()) or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name}")


class _Reader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        with open(Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata"), "rb") as f:
            metadata = _SafeUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _group_names(target: CheckpointTarget, owned: list[OwnedSlice]) -> list[list[str]]:
    """The parameter names of each optimizer group, over all ranks (a rank may own no slice of some). Collective."""
    index = {id(p): i for i, g in enumerate(target.optimizer.param_groups) for p in g["params"]}
    mine = list(
        {o.slice.name: index.get(id(o.optimizer_param), 0) for o in owned if o.optimizer_param is not None}.items()
    )
    every = all_gather_objects(mine)  # a parameter the optimizer does not hold itself (offload's stand-ins): group 0
    order = {n: i for i, (n, _) in enumerate(target.module.named_parameters())}  # FSDP2 lists them in module order
    found = dict(sorted({n: i for part in every for n, i in part}.items(), key=lambda e: order.get(e[0], len(order))))
    groups: list[list[str]] = [[] for _ in target.optimizer.param_groups]
    for name, i in found.items():
        groups[i].append(name)
    return groups


def save_dcp(target: CheckpointTarget, path: str | Path, *, optimizer: bool = True) -> None:
    """Write ``target`` as a DCP checkpoint at ``path`` that FSDP2 (``dcp.load`` + ``set_state_dict``) reads. Collective.

    Each rank writes the slices it owns (fp32 master weights, optimizer moments) as boxes of the
    global tensors; nothing is gathered. ``optimizer=False`` writes the model only.
    """
    owned = target.shards.sharded_state()
    groups = _group_names(target, owned) if optimizer else []
    plain, pieces = agree(lambda: _save_plan(target, owned, groups, optimizer), "save_dcp")
    dcp.save(plain, storage_writer=dcp.FileSystemWriter(str(path)), planner=_SavePlanner(pieces))


def _save_plan(
    target: CheckpointTarget, owned: list[OwnedSlice], groups: list[list[str]], optimizer: bool
) -> tuple[dict, dict]:
    rank = dist.get_rank() if dist.is_initialized() else 0
    names = {id(p): n for n, p in target.module.named_parameters()}
    aliases: dict[str, list[str]] = {}
    for key, entry in state_dict_keys(target.module, names).items():
        aliases.setdefault(entry.get("param", entry.get("buffer", key)), []).append(key)
    pieces: dict[str, tuple[tuple[int, ...], dict[tuple[int, ...], torch.Tensor]]] = {}

    def add(key: str, part: ParamSlice, flat: torch.Tensor) -> None:
        boxes = pieces.setdefault(key, (tuple(part.shape), {}))[1]
        at = 0
        for offsets, sizes in flat_boxes(tuple(part.sizes), part.start, part.start + part.numel):
            n = math.prod(sizes)
            boxes[tuple(o + b for o, b in zip(offsets, part.offsets))] = flat[at : at + n].view(sizes)
            at += n

    scalars: dict[str, dict[str, Any]] = {}
    for o in owned:
        if o.duplicate:
            continue
        state = target.shards.slice_optimizer_state(o) if optimizer and o.optimizer_param is not None else None
        for lo, hi, part in o.slice.split():
            value = o.value.detach()[lo:hi]
            for key in aliases.get(part.name, [part.name]):
                add(MODEL + key, part, value if value.dtype == torch.float32 else value.float())
            for name, v in (state or {}).items():
                if torch.is_tensor(v) and v.dim() > 0 and v.numel() == o.slice.numel:
                    add(f"{STATE}{part.name}.{name}", part, v.detach().reshape(-1)[lo:hi])
                else:  # torch keeps step as a 0-dim float32 tensor; FusedAdam as a Python float
                    scalars.setdefault(part.name, {})[name] = (
                        torch.tensor(v, dtype=torch.float32) if name == "step" and isinstance(v, (int, float)) else v
                    )
    plain: dict[str, Any] = {"model": {}}
    if rank == 0:
        for name, buf in persistent_buffers(target.module).items():
            for key in aliases.get(name, [name]):
                plain["model"][key] = buf.detach()
        for name, p in target.module.named_parameters():
            shape = global_shape_and_box(p)[0]
            if math.prod(shape) == 0:  # no slice holds it: an empty chunk keeps the key
                for key in aliases.get(name, [name]):
                    pieces[MODEL + key] = (shape, {(0,) * len(shape): torch.empty(shape)})
        plain["slipstream"] = _extras(target)
    if optimizer:
        plain["optimizer"] = {"state": scalars, "param_groups": _saved_groups(target.optimizer, groups)}
    return plain, pieces


def _saved_groups(opt: torch.optim.Optimizer, names: list[list[str]]) -> list[dict[str, Any]]:
    """One saved group per distinct set of hyperparameters (expert parallelism splits a user's group in two)."""
    saved: list[dict[str, Any]] = []
    for group, params in zip(opt.param_groups, names):
        entry = {k: v for k, v in group.items() if k != "params"}
        if "adamw_mode" in entry:  # so that FSDP2's Adam/AdamW finds every key its own group has
            entry = {**TORCH_ADAM, **entry, "decoupled_weight_decay": bool(entry["adamw_mode"])}
            del entry["adamw_mode"]
        same = next((s for s in saved if same_values({k: v for k, v in s.items() if k != "params"}, entry)), None)
        if same is not None:
            same["params"] = [*same["params"], *params]
        else:
            saved.append({**entry, "params": list(params)})
    return saved


def _extras(target: CheckpointTarget) -> dict[str, Any]:
    """Counters, scheduler and loss scaler as JSON trees with tensors (nothing pickled)."""
    states = {"counters": target.counters.state_dict(), "loss_scaler": target.loss_scaler.state_dict()}
    if target.scheduler is not None:
        states["lr_scheduler"] = target.scheduler.state_dict()
    extras: dict[str, Any] = {"format": json.dumps({"world_size": target.world_size, "zero_stage": target.zero_stage})}
    for name, state in states.items():
        tensors: dict[str, torch.Tensor] = {}
        tree = encode_tree(state, "t", tensors, f"{name}.state_dict()")
        extras[name] = {"tree": json.dumps(tree), **({"tensors": tensors} if tensors else {})}
    return extras


@dataclasses.dataclass
class _Request:
    """What this rank asks DCP for, and where each answer lands (views into the buffers DCP fills)."""

    plain: dict[str, Any] = dataclasses.field(default_factory=dict)  # flat key -> tensor to fill, or None (bytes)
    boxes: dict[str, list[tuple[Box, torch.Tensor]]] = dataclasses.field(default_factory=dict)
    values: dict[ParamSlice, list[tuple[int, int, torch.Tensor]]] = dataclasses.field(default_factory=dict)
    states: dict[ParamSlice, dict[str, Any] | None] | None = None  # name -> parts (per element) or a plain key
    buffers: dict[str, str] = dataclasses.field(default_factory=dict)
    groups: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)  # group index or fqn -> {key: flat key}
    nested_groups: bool = True
    extras: dict[str, tuple[str, dict[str, str]]] = dataclasses.field(default_factory=dict)

    def rows(self, key: str, slice_: ParamSlice, dtype: torch.dtype) -> list[tuple[int, int, torch.Tensor]]:
        """Ask for the rows covering each box of ``slice_``: ``(lo, hi, flat view)`` per part."""
        found = []
        for lo, hi, part in slice_.split():
            box, skip = part.covering_rows()
            buffer = torch.empty(box[1], dtype=dtype)
            self.boxes.setdefault(key, []).append((box, buffer))
            found.append((lo, hi, buffer.view(-1)[skip : skip + part.numel]))
        return found


def load_dcp(target: CheckpointTarget, path: str | Path, *, optimizer: bool = True) -> None:
    """Load a DCP checkpoint (FSDP2's ``get_state_dict`` layout, torchtitan's, or ``save_dcp``'s) into ``target``. Collective.

    Any world size: each rank reads just the rows holding its slices. Names and shapes are checked
    first, and everything is read before anything is applied: a refused or failed load leaves the
    target as it was (a :class:`CheckpointError` naming the key).
    """
    path = Path(path)
    owned = target.shards.sharded_state()
    groups = _group_names(target, owned) if optimizer else []
    reader = _Reader(str(path))
    request: _Request = agree(lambda: _load_plan(target, path, reader, owned, optimizer), "load_dcp")
    try:
        dcp.load(request.plain, storage_reader=reader, planner=_LoadPlanner(request.boxes))
    except Exception as err:  # noqa: BLE001 - DCP raises the same on every rank
        raise _fail(path, f"reading it failed ({type(err).__name__}: {' '.join(str(err).split())[:300]})") from err
    stateful, group_values, values, states = agree(lambda: _decode(target, path, request, owned, groups), "load_dcp")
    apply_stateful(stateful, path)
    for group, hyper in group_values:
        apply_group(group, hyper)
    target.shards.load_sharded_state(values.__getitem__)
    with torch.no_grad():
        for name, buf in persistent_buffers(target.module).items():
            if name in request.buffers:
                buf.copy_(request.plain[request.buffers[name]])
    for o in owned:
        if states is not None and o.optimizer_param is not None:
            target.shards.load_slice_optimizer_state(o, states[o.slice])


def _fail(path: Path, message: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {path}: {message}; nothing was loaded")


def _check_tensor(path: Path, md: dict[str, Any], key: str, shape: tuple[int, ...], what: str) -> None:
    entry = md[key]
    if not isinstance(entry, TensorStorageMetadata):
        raise _fail(path, f"{what} is not a tensor in it (key {key!r})")
    if tuple(entry.size) != tuple(shape):
        raise _fail(
            path, f"{what} has shape {list(entry.size)} in the checkpoint but {list(shape)} in the model (key {key!r})"
        )
    held = sum(math.prod(c.sizes) for c in entry.chunks)
    if held != math.prod(shape):
        raise _fail(
            path,
            f"{what}: its chunks hold {held} of {math.prod(shape)} elements (key {key!r}; the checkpoint is damaged)",
        )


def _placeholder(entry: Any) -> Any:
    return torch.empty(entry.size, dtype=entry.properties.dtype) if isinstance(entry, TensorStorageMetadata) else None


def _load_plan(
    target: CheckpointTarget, path: Path, reader: _Reader, owned: list[OwnedSlice], optimizer: bool
) -> _Request:
    try:
        md = reader.read_metadata().state_dict_metadata
    except FileNotFoundError:
        raise _fail(path, "no DCP checkpoint here (no .metadata file)") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as err:
        raise _fail(path, f"its .metadata cannot be read ({err})") from None
    module = target.module
    names = {id(p): n for n, p in module.named_parameters()}
    aliases: dict[str, list[str]] = {}
    for key, entry in state_dict_keys(module, names).items():
        aliases.setdefault(entry.get("param", entry.get("buffer", key)), []).append(key)
    shapes = {n: tuple(global_shape_and_box(p)[0]) for n, p in module.named_parameters()}
    # FSDP2's get_state_dict nests the model under "model"; torchtitan saves its keys at the top.
    prefix = MODEL if all(any(MODEL + k in md for k in aliases.get(n, [n])) for n in shapes) else ""
    where: dict[str, str] = {}
    for n, shape in shapes.items():
        key = next((prefix + k for k in aliases.get(n, [n]) if prefix + k in md), None)
        if key is None:
            raise _fail(path, f"parameter {n!r} is not in it (no key {MODEL + n!r})")
        _check_tensor(path, md, key, shape, f"parameter {n!r}")
        where[n] = key
    request = _Request()
    for o in owned:
        request.values[o.slice] = request.rows(where[o.slice.name], o.slice, o.value.dtype)
    for name, buf in persistent_buffers(module).items():
        key = next((prefix + k for k in aliases.get(name, [name]) if prefix + k in md), None)
        if key is None:
            logger.warning("checkpoint %s holds no buffer %r; it keeps its value", path, name)
            continue
        _check_tensor(path, md, key, tuple(buf.shape), f"buffer {name!r}")
        request.buffers[name], request.plain[key] = key, torch.empty(buf.shape, dtype=buf.dtype)
    if optimizer:
        _plan_optimizer(path, md, shapes, owned, request)
    for key, entry in md.items():  # our own extras, when the checkpoint is ours
        name, _, rest = key[len(EXTRA) :].partition(".")
        if key.startswith(EXTRA) and name in ("counters", "lr_scheduler", "loss_scaler"):
            tree, tensors = request.extras.setdefault(name, ("", {}))
            if rest.startswith("tensors."):
                tensors[rest[len("tensors.") :]] = key
            request.extras[name] = (key if rest == "tree" else tree, tensors)
            request.plain[key] = _placeholder(entry)
    return request


def _plan_optimizer(
    path: Path, md: dict[str, Any], shapes: dict[str, tuple[int, ...]], owned: list[OwnedSlice], request: _Request
) -> None:
    if not any(k.startswith(STATE) for k in md):
        raise _fail(path, "it holds no optimizer state (no optimizer.state.* keys); load with optimizer=False")
    by_param: dict[str, dict[str, str]] = {}
    for key in md:
        fqn, _, name = key[len(STATE) :].rpartition(".")
        if key.startswith(STATE) and fqn in shapes:
            by_param.setdefault(fqn, {})[name] = key
    request.states = {}
    for o in owned:
        if o.optimizer_param is None:
            continue
        shape, entry = shapes[o.slice.name], {}
        for name, key in by_param.get(o.slice.name, {}).items():
            m = md[key]
            per_element = (
                isinstance(m, TensorStorageMetadata) and tuple(m.size) == shape and (len(shape) > 0 or name != "step")
            )
            if per_element:
                _check_tensor(path, md, key, shape, f"optimizer state {name!r} of {o.slice.name!r}")
                entry[name] = request.rows(key, o.slice, o.optimizer_param.dtype)
            elif isinstance(m, TensorStorageMetadata) and len(m.size) > 0:
                raise _fail(
                    path,
                    f"optimizer state {name!r} of {o.slice.name!r} has shape {list(m.size)}, the parameter {list(shape)} (key {key!r})",
                )
            else:
                entry[name], request.plain[key] = key, _placeholder(m)
        request.states[o.slice] = entry or None
    group_keys = [k for k in md if k.startswith(GROUPS)]
    request.nested_groups = any(
        k[len(GROUPS) :].partition(".")[0].isdigit() and k.endswith(".params") for k in group_keys
    )
    for key in group_keys:
        rest = key[len(GROUPS) :]
        owner, _, hyper = rest.partition(".") if request.nested_groups else rest.rpartition(".")
        if request.nested_groups or owner in shapes:
            request.groups.setdefault(owner, {})[hyper] = key
            request.plain[key] = _placeholder(md[key])


def _decode(
    target: CheckpointTarget, path: Path, request: _Request, owned: list[OwnedSlice], groups: list[list[str]]
) -> tuple[
    list[tuple[str, Any, Any]], list[tuple[dict[str, Any], dict[str, Any]]], dict[ParamSlice, torch.Tensor], Any
]:
    """Everything read turned into what is applied, checked (after DCP's read, before any change)."""
    plain = request.plain
    values = {s: _joined(parts, s.numel) for s, parts in request.values.items()}
    states = None
    if request.states is not None:
        group_of = {id(p): g for g in target.optimizer.param_groups for p in g["params"]}
        states = {}
        for o in owned:
            if o.optimizer_param is None:
                continue
            param, group, state = o.optimizer_param, group_of.get(id(o.optimizer_param), {}), {}
            for name, found in (request.states.get(o.slice) or {}).items():
                if isinstance(found, list):
                    state[name] = _joined(found, o.slice.numel).reshape(param.shape).to(param.device)
                elif torch.is_tensor(plain[found]):  # a scalar such as step: where torch's optimizers keep it
                    state[name] = plain[found].to(
                        param.device if group.get("fused") or group.get("capturable") else "cpu"
                    )
                else:
                    state[name] = plain[found]
            states[o.slice] = state or None
    group_values = _decode_groups(target.optimizer, path, request, groups) if request.states is not None else []
    stateful = []
    for name, (tree_key, tensor_keys) in ((n, e) for n, e in request.extras.items() if e[0]):
        try:
            state = decode_tree(json.loads(plain[tree_key]), {k: plain[v] for k, v in tensor_keys.items()})
        except (TypeError, ValueError, KeyError) as err:
            raise _fail(path, f"its slipstream.{name} cannot be decoded ({err})") from None
        if name == "counters":
            stateful.append(("counters", target.counters, dataclasses.asdict(counters_from(path, state, target))))
        elif name == "lr_scheduler" and target.scheduler is not None:
            stateful.append(("lr_scheduler", target.scheduler, state))
        elif name == "loss_scaler" and isinstance(state, dict) and set(state) == set(target.loss_scaler.state_dict()):
            stateful.append(("loss scaler", target.loss_scaler, state))
    return stateful, group_values, values, states


def _joined(parts: list[tuple[int, int, torch.Tensor]], numel: int) -> torch.Tensor:
    if len(parts) == 1 and parts[0][:2] == (0, numel):
        return parts[0][2]
    out = torch.empty(numel, dtype=parts[0][2].dtype if parts else torch.float32)
    for lo, hi, flat in parts:
        out[lo:hi] = flat
    return out


def _decode_groups(
    opt: torch.optim.Optimizer, path: Path, request: _Request, groups: list[list[str]]
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """``(current group, saved hyperparameters)``: each group takes the saved group of its parameters."""
    saved = {owner: {h: request.plain[k] for h, k in keys.items()} for owner, keys in request.groups.items()}
    of_param: dict[str, dict[str, Any]] = {}
    for owner, hyper in saved.items():
        members = hyper.get("params", []) if request.nested_groups else [owner]
        if not isinstance(members, list) or not all(isinstance(n, str) for n in members):
            raise _fail(
                path,
                f"optimizer.param_groups.{owner}.params is {members!r}, expected a list of names (the checkpoint is damaged)",
            )
        for name in members:
            of_param[name] = hyper
    found = []
    for group, names in zip(opt.param_groups, groups):
        matched = [(n, of_param[n]) for n in names if n in of_param]
        if not matched:
            continue
        first, hyper = matched[0]
        other = next((n for n, h in matched if h is not hyper and not same_values(h, hyper)), None)
        if other is not None:
            raise _fail(
                path, f"parameters {first!r} and {other!r} share an optimizer group here but not in the checkpoint"
            )
        if "adamw_mode" in group and "decoupled_weight_decay" in hyper:  # saved by torch's Adam/AdamW
            hyper = {**hyper, "adamw_mode": bool(hyper["decoupled_weight_decay"])}
        hyper = {k: v for k, v in hyper.items() if k not in IMPLEMENTATION and k in group}
        for key, value in hyper.items():
            current = group[key]
            value = value.item() if torch.is_tensor(value) and value.numel() == 1 else value
            if isinstance(current, tuple):
                ok = isinstance(value, (list, tuple)) and len(value) == len(current) and all(map(finite, value))
            else:
                ok = finite(value) if torch.is_tensor(current) or finite(current) else True
            if not ok:
                raise _fail(
                    path,
                    f"optimizer group hyperparameter {key!r} of {first!r} is {value!r}, this optimizer has {current!r}",
                )
            hyper[key] = value
        found.append((group, hyper))
    return found
