"""Writing a slipstream checkpoint from a DeepSpeed one, one DeepSpeed rank's partition at a time.

The converted checkpoint keeps DeepSpeed's partitioning as its rank files (each DeepSpeed rank's
shares of the parameters become that rank's slices), so converting holds one rank's optimizer
file in memory at a time, and loading it reshards to any world size, stage and mesh through the
ordinary reader. The fp32 master weights, the optimizer's per-element state and its step, the
parameter groups' hyperparameters, the LR scheduler, an fp16 loss scaler, the step counters and
the caller's ``client_state`` are carried over; DeepSpeed saves no RNG state, so a resumed run
keeps its own generators.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from slipstream.engine.checkpoint import writer
from slipstream.engine.checkpoint.capture import Payload
from slipstream.engine.checkpoint.format import FORMAT_NAME, FORMAT_VERSION, encode_tree, key_part
from slipstream.engine.checkpoint.formats.deepspeed.partitions import Share, zero3_shares, zero12_shares, zero12_total
from slipstream.engine.checkpoint.formats.deepspeed.source import DeepSpeedCheckpoint, describe
from slipstream.engine.checkpoint.formats.deepspeed.unpickle import load_pickle
from slipstream.engine.checkpoint.tiling import piece_key
from slipstream.engine.checkpoint.validate import CheckpointError
from slipstream.utils.pieces import ParamSlice, whole_box
from slipstream.version import __version__

# A piece of the output: the share, its fp32 values, its optimizer state (per-element tensors, scalars).
Piece = tuple[Share, torch.Tensor, dict[str, Any]]
UNIVERSAL_FILE_BYTES = 2 * 2**30  # a universal checkpoint's whole tensors go into rank files of about this size


def convert(source: Path, save_dir: Path, tag: str, *, save_latest: bool = True) -> Path:
    """Write the DeepSpeed checkpoint directory ``source`` as slipstream checkpoint ``save_dir/tag``; returns its path."""
    ds = describe(source)
    world, ranks = _ranks(ds)
    lock = writer.prepare(save_dir, tag)
    try:
        tmp = writer.temp_dir(save_dir, tag)
        parameters: dict[str, dict[str, Any]] = {}
        for rank, pieces in enumerate(ranks):
            payload = _payload(ds, rank, world, pieces, parameters)
            if rank == 0:
                payload.meta["common"] = _common(ds, payload.tensors)
                payload.config = ds.config
            writer.write_rank(tmp, payload)
        manifest = _manifest(ds, tag, world, parameters)
        return writer.commit(save_dir, tag, tmp, world, manifest, save_latest, timeout=60.0)
    finally:
        lock.release()


def _ranks(ds: DeepSpeedCheckpoint) -> tuple[int, Iterator[list[Piece]]]:
    """How many rank files the output has, and each one's pieces (read when asked for)."""
    if ds.universal:
        batches = _universal_batches(ds)
        return len(batches), (_universal(ds, names) for names in batches)
    if not ds.optim_files:
        return 1, iter([_zero0(ds)])
    return ds.world, _zero(ds)


# --------------------------------------------------------------------------- ZeRO 1-3


def _zero(ds: DeepSpeedCheckpoint) -> Iterator[list[Piece]]:
    shapes, merged = ds.param_shapes(), ds.merged_param_shapes()
    for rank, file in enumerate(ds.optim_files):
        saved = load_pickle(file)
        opt = saved.get("optimizer_state_dict") if isinstance(saved, dict) else None
        if not isinstance(opt, dict):
            raise CheckpointError(f"DeepSpeed checkpoint {ds.path}: {file.name} holds no optimizer_state_dict")
        stage = int(opt.get("zero_stage", ds.zero_stage))
        if stage == 3:
            yield _zero3_rank(ds, file, opt, merged, rank)
        else:
            yield _zero12_rank(ds, file, opt, shapes, rank)


def _zero12_rank(
    ds: DeepSpeedCheckpoint, file: Path, opt: dict[str, Any], shapes: list[dict[str, Any]], rank: int
) -> list[Piece]:
    flats = opt.get("single_partition_of_fp32_groups")
    paddings = opt.get("group_paddings")
    if not isinstance(flats, list) or len(flats) != len(shapes) or not isinstance(paddings, list):
        raise CheckpointError(
            f"DeepSpeed checkpoint {ds.path}: {file.name} has {len(flats) if isinstance(flats, list) else 'no'} fp32 partitions "
            f"for {len(shapes)} parameter groups (damaged, or another DeepSpeed layout)"
        )
    alignment = opt.get("param_alignment_paddings")
    states = _group_states(ds, file, opt.get("base_optimizer_state"), len(shapes))
    pieces: list[Piece] = []
    for g, (group, flat) in enumerate(zip(shapes, flats)):
        aligned = alignment[g] if isinstance(alignment, list) and g < len(alignment) else None
        held = flat.numel()
        partition = held + int(paddings[g])
        if rank == ds.world - 1 and rank * partition + held < zero12_total(group, aligned):
            raise CheckpointError(
                f"DeepSpeed checkpoint {ds.path}: group {g}'s partitions hold fewer elements than its parameters"
            )
        for share in zero12_shares(group, aligned, rank, partition, held):
            pieces.append(_piece(share, flat, states[g]))
    return pieces


def _zero3_rank(
    ds: DeepSpeedCheckpoint, file: Path, opt: dict[str, Any], shapes: dict[str, tuple[int, ...]], rank: int
) -> list[Piece]:
    groups = opt.get("fp32_flat_groups")
    if not isinstance(groups, list) or not all(torch.is_tensor(t) for t in groups):
        raise CheckpointError(f"DeepSpeed checkpoint {ds.path}: {file.name} holds no fp32_flat_groups")
    if opt.get("ds_zero_partition_groups"):
        raise CheckpointError(
            f"DeepSpeed checkpoint {ds.path} partitions ZeRO-3 over sub-groups (hpZ/MiCS); convert it with ds_to_universal first"
        )
    flat = groups[0].reshape(-1) if len(groups) == 1 else torch.cat([t.reshape(-1) for t in groups])
    shares, length = zero3_shares(shapes, rank, ds.world)
    if length != flat.numel():
        raise CheckpointError(
            f"DeepSpeed checkpoint {ds.path}: {file.name} holds {flat.numel()} fp32 elements, its parameters' shares need {length}"
        )
    inner = opt.get("optimizer_state_dict")
    state = inner.get("state") if isinstance(inner, dict) else None
    per_group = [state[k] for k in sorted(state)] if isinstance(state, dict) else []
    joined: dict[str, Any] = {}
    if per_group:
        for key, value in per_group[0].items():
            if torch.is_tensor(value) and value.dim() > 0:
                parts = [s[key].reshape(-1) for s in per_group]
                joined[key] = parts[0] if len(parts) == 1 else torch.cat(parts)
                if joined[key].numel() != flat.numel():
                    raise CheckpointError(
                        f"DeepSpeed checkpoint {ds.path}: {file.name}'s optimizer state {key!r} does not match its fp32 partition"
                    )
            else:
                joined[key] = value
    return [_piece(share, flat, joined) for share in shares]


def _group_states(ds: DeepSpeedCheckpoint, file: Path, base: Any, groups: int) -> list[dict[str, Any]]:
    """Per flat group, its optimizer state (per-element tensors as long as the saved partition, or longer)."""
    if isinstance(base, list):  # elastic: one lean state per group
        found = base
    elif isinstance(base, dict) and isinstance(base.get("state"), dict):
        state = base["state"]
        found = [state.get(i, state.get(str(i), {})) for i in range(groups)]
    else:
        found = [{} for _ in range(groups)]
    if len(found) != groups:
        raise CheckpointError(
            f"DeepSpeed checkpoint {ds.path}: {file.name} has optimizer state for {len(found)} of {groups} groups"
        )
    return [dict(s) if isinstance(s, dict) else {} for s in found]


def _piece(share: Share, flat: torch.Tensor, state: dict[str, Any]) -> Piece:
    # Views, not copies: the files are memory-mapped, so each byte is read once, as the rank file is written.
    lo, hi = share.offset, share.offset + share.numel
    values = flat.reshape(-1)[lo:hi].float()
    mine: dict[str, Any] = {}
    for key, value in state.items():
        if torch.is_tensor(value) and value.dim() > 0:
            if value.numel() < hi:
                raise CheckpointError(f"optimizer state {key!r} is shorter than its fp32 partition")
            mine[key] = value.reshape(-1)[lo:hi]
        else:
            mine[key] = value
    return share, values, mine


# --------------------------------------------------------------------------- ZeRO 0 and universal


def _zero0(ds: DeepSpeedCheckpoint) -> list[Piece]:
    """ZeRO 0: whole weights from the module state dict, the optimizer's state by parameter index."""
    module = ds.model_state["module"]
    params = ds.module_params()
    saved = ds.model_state.get("optimizer")
    state = saved.get("state") if isinstance(saved, dict) else None
    order = [i for g in saved.get("param_groups", []) for i in g.get("params", [])] if isinstance(saved, dict) else []
    if isinstance(state, dict) and state and len(order) != len(params):
        raise CheckpointError(
            f"DeepSpeed checkpoint {ds.path}: its optimizer holds {len(order)} parameters, the module {len(params)}; "
            "slipstream maps them in the module's parameter order (an optimizer over a subset cannot be mapped)"
        )
    by_name = dict(zip(params, order))
    pieces = []
    for name in params:
        value = module[name]
        share = Share(name, tuple(value.shape), 0, value.numel(), 0)
        entry = state.get(by_name[name], {}) if isinstance(state, dict) and name in by_name else {}
        pieces.append(_piece(share, value.reshape(-1), dict(entry)))
    return pieces


def _universal_batches(ds: DeepSpeedCheckpoint) -> list[list[str]]:
    """The parameters of each output rank file: about :data:`UNIVERSAL_FILE_BYTES` of fp32 weights and state each."""
    shapes = ds.parameter_shapes()
    batches: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        if size >= UNIVERSAL_FILE_BYTES:
            batches.append([])
            size = 0
        batches[-1].append(name)
        size += math.prod(shape) * 4 * 3  # weights and two moments
    return batches


def _universal(ds: DeepSpeedCheckpoint, names: list[str]) -> list[Piece]:
    """Universal: whole tensors of ``names`` from ``zero/<name>/*.pt`` (ZeRO-3's are saved flat: shaped by ``param_shapes``)."""
    zero = ds.path / "zero"
    shapes = ds.merged_param_shapes()
    batch: list[Piece] = []
    shared_step = ds.optimizer_globals["step"]
    for name in names:
        folder = zero / name
        if not (folder / "fp32.pt").is_file():
            raise CheckpointError(f"universal DeepSpeed checkpoint {ds.path}: zero/{name}/fp32.pt is missing")
        value = _universal_tensor(folder / "fp32.pt")
        shape = shapes.get(name, tuple(value.shape))
        if math.prod(shape) != value.numel():
            raise CheckpointError(
                f"universal DeepSpeed checkpoint {ds.path}: zero/{name}/fp32.pt holds {value.numel()} elements, "
                f"param_shapes says {list(shape)}"
            )
        value = value.reshape(shape)
        state: dict[str, Any] = {}
        for file in sorted(folder.glob("*.pt")):
            key = file.stem
            if key == "fp32":
                continue
            tensor = _universal_tensor(file)
            state[key] = tensor.reshape(()) if key == "step" and torch.is_tensor(tensor) else tensor
        if "step" not in state and shared_step is not None and state:  # ZeRO-3's universal layout keeps one step
            state["step"] = shared_step
        share = Share(name, tuple(value.shape), 0, value.numel(), 0)
        batch.append(_piece(share, value.reshape(-1), state))
    return batch


def _universal_tensor(file: Path) -> Any:
    saved = load_pickle(file)
    value = saved.get("param") if isinstance(saved, dict) else saved
    if value is None:
        raise CheckpointError(f"universal DeepSpeed checkpoint file {file} holds no 'param'")
    return value


# --------------------------------------------------------------------------- files


def _payload(
    ds: DeepSpeedCheckpoint, rank: int, world: int, pieces: list[Piece], parameters: dict[str, dict[str, Any]]
) -> Payload:
    tensors: dict[str, torch.Tensor] = {}
    slices = []
    for share, values, state in pieces:
        whole = whole_box(share.shape)
        key = piece_key("p", share.name, whole, share.shape, share.start, FORMAT_VERSION)
        tensors[key] = values
        entry: dict[str, Any] = {
            **ParamSlice(share.name, tuple(share.shape), share.start, share.numel).entry(),
            "key": key,
        }
        if state:
            entry["optimizer"] = opt = {}
            prefix = piece_key("o", share.name, whole, share.shape, share.start, FORMAT_VERSION)
            for name, value in state.items():
                okey = f"{prefix}/{key_part(name)}"
                if torch.is_tensor(value) and value.dim() > 0:
                    tensors[okey] = value
                    opt[name] = {"slice": okey}
                elif torch.is_tensor(value):
                    tensors[okey] = value
                    opt[name] = {"tensor": okey, "on_param_device": False}
                else:
                    opt[name] = {
                        "value": encode_tree(value, okey, tensors, f"optimizer state {name!r} of {share.name}")
                    }
        slices.append(entry)
        parameters.setdefault(share.name, {"shape": list(share.shape), "dtype": "float32", "trainable": True})
    meta: dict[str, Any] = {"rank": rank, "world_size": world, "slices": slices, "rng": {}, "stateful": {}}
    return Payload(rank, tensors, meta)


def _common(ds: DeepSpeedCheckpoint, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    module = ds.model_state["module"]
    buffers = {}
    for name in ds.buffer_names():
        if name in module and torch.is_tensor(module[name]):
            buffers[name] = f"b/{key_part(name)}"
            tensors[buffers[name]] = module[name].contiguous()
    groups = [
        _plain({k: v for k, v in g.items() if k != "params"})
        for g in ds.optimizer_globals["param_groups"]
        if isinstance(g, dict)
    ]
    scheduler = ds.model_state.get("lr_scheduler")
    return {
        "counters": ds.counters(),
        "optimizer_groups": encode_tree(groups, "common/optimizer_groups", tensors, "optimizer.param_groups"),
        "lr_scheduler": None
        if scheduler is None
        else encode_tree(scheduler, "common/lr_scheduler", tensors, "lr_scheduler"),
        "loss_scaler": ds.loss_scaler(ds.optimizer_globals["loss_scaler"]),
        "client_state": encode_tree(_plain(ds.client_state()), "common/client_state", tensors, "client_state"),
        "buffers": buffers,
    }


def _plain(obj: Any) -> Any:
    """``obj`` with DeepSpeed stand-ins and other non-JSON objects as their attributes or their text."""
    from slipstream.engine.checkpoint.formats.deepspeed.unpickle import DeepSpeedRecord

    if isinstance(obj, dict):
        return {
            k if isinstance(k, (str, int)) and not isinstance(k, bool) else str(k): _plain(v) for k, v in obj.items()
        }
    if isinstance(obj, (list, tuple)):
        return type(obj)(_plain(v) for v in obj)
    if isinstance(obj, DeepSpeedRecord):
        return _plain(dict(vars(obj)))
    if obj is None or isinstance(obj, (bool, int, float, str)) or torch.is_tensor(obj):
        return obj
    return str(obj)


def _manifest(ds: DeepSpeedCheckpoint, tag: str, world: int, parameters: dict[str, dict[str, Any]]) -> dict[str, Any]:
    module = ds.model_state["module"]
    buffers = {
        n: {"shape": list(module[n].shape), "dtype": str(module[n].dtype).removeprefix("torch.")}
        for n in ds.buffer_names()
        if n in module and torch.is_tensor(module[n])
    }
    shared = ds.shared_params()
    keys: dict[str, dict[str, str]] = {}
    for key in module:
        if key in buffers:
            keys[key] = {"buffer": key}
        elif key in parameters:
            keys[key] = {"param": key}
        elif shared.get(key) in parameters:
            keys[key] = {"param": shared[key]}
    for name in parameters:
        keys.setdefault(name, {"param": name})
    counters = ds.counters()
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "tag": tag,
        "created": time.time(),
        "slipstream_version": __version__,
        "torch_version": torch.__version__,
        "world_size": world,
        "zero_stage": ds.zero_stage,
        "precision": ds.precision,
        "global_steps": counters["global_steps"],
        "micro_steps": counters["micro_steps"],
        "module_class": f"converted from DeepSpeed {ds.version}",
        "source": {
            "format": "deepspeed-universal" if ds.universal else "deepspeed",
            "deepspeed_version": ds.version,
            "path": str(ds.path),
            "world_size": ds.world,
        },
        "parameters": parameters,
        "buffers": buffers,
        "state_dict_keys": keys,
    }
