"""``slipstream checkpoint inspect|export|convert``: read checkpoints offline, from their files alone (DeepSpeed's too)."""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

from slipstream.engine.checkpoint.formats.deepspeed.source import locate as locate_deepspeed
from slipstream.engine.checkpoint.reader import (
    CheckpointError,
    CheckpointReader,
    complete_checkpoints,
    latest_tag,
    resolve,
)


def main(args: argparse.Namespace) -> int:
    """Entry point of ``slipstream checkpoint``: a user error is one line on stderr and status 1, never a traceback."""
    try:
        if args.checkpoint_command == "inspect":
            foreign = locate_deepspeed(args.dir, args.tag)
            return inspect_deepspeed(foreign) if foreign is not None else inspect(Path(args.dir), args.tag, args.verify)
        if args.checkpoint_command == "convert":
            return _convert(Path(args.dir), Path(args.out), args.tag)
        return _export(args)
    except CheckpointError as err:
        print(f"slipstream checkpoint: {err}", file=sys.stderr)
        return 1
    except OSError as err:
        print(f"slipstream checkpoint: {err}", file=sys.stderr)
        return 1


def _convert(directory: Path, out: Path, tag: str | None) -> int:
    """DeepSpeed -> slipstream (same tag, ``latest`` written), or slipstream -> DeepSpeed universal."""
    foreign = locate_deepspeed(directory, tag)
    if foreign is not None:
        from slipstream.engine.checkpoint.formats.deepspeed.convert import convert

        if out.resolve().is_relative_to(foreign.resolve()):
            raise CheckpointError(f"convert: {out} lies inside the DeepSpeed checkpoint {foreign}; write elsewhere")
        path = convert(foreign, out, foreign.name)
        print(
            f"wrote slipstream checkpoint {path} from DeepSpeed checkpoint {foreign} (loads at any world size and stage)"
        )
        return 0
    from slipstream.engine.checkpoint.formats.deepspeed.export import export_deepspeed

    path = export_deepspeed(directory, out, tag)
    print(
        f'wrote DeepSpeed universal checkpoint {path} (DeepSpeed loads it with "checkpoint": {{"load_universal": true}})'
    )
    return 0


def inspect_deepspeed(path: Path) -> int:
    """A DeepSpeed checkpoint's summary, read through the allow-listed unpickler (nothing of it runs)."""
    from slipstream.engine.checkpoint.formats.deepspeed.source import describe

    ds = describe(path)
    shapes = ds.parameter_shapes()
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    counters = ds.counters()
    kind = "universal" if ds.universal else f"ZeRO stage {ds.zero_stage}, {ds.world} data-parallel rank(s)"
    print(f"checkpoint      {path}")
    print(f"written by      DeepSpeed {ds.version} ({kind}), {ds.precision}")
    print(
        f"training        step {counters['global_steps']}, {counters['global_samples']} samples, {counters['skipped_steps']} skipped"
    )
    print(
        f"model           {len(shapes)} parameters, {sum(_numel(list(s)) for s in shapes.values()):,} elements; "
        f"{len(ds.buffer_names())} buffers, {len(ds.shared_params())} tied aliases"
    )
    print(f"lr_scheduler    {'saved' if ds.model_state.get('lr_scheduler') is not None else 'none'}")
    print(f"client_state    {', '.join(sorted(ds.client_state())) or 'empty'}")
    print(f"files           {sum(1 for f in path.rglob('*') if f.is_file())}, {size / 2**20:.1f} MiB")
    print(
        "loads with      engine.load_checkpoint (any world size, stage and mesh); 'slipstream checkpoint convert' writes ours"
    )
    return 0


def _export(args: argparse.Namespace) -> int:
    """``--format safetensors`` (default): one fp32 file of every state_dict key; ``--format hf``: Hugging Face's
    sharded layout in a directory (``model-0000i-of-0000n.safetensors`` + index), one parameter in memory at a time."""
    fmt, dtype = getattr(args, "format", None) or "safetensors", getattr(args, "dtype", None)
    if fmt == "hf":
        import torch

        from slipstream.engine.checkpoint.formats.hf.export import DEFAULT_MAX_SHARD_SIZE, export_hf

        try:
            path, plan = export_hf(
                args.dir,
                args.out,
                args.tag,
                {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype or "fp32", torch.float32),
                getattr(args, "max_shard_size", None) or DEFAULT_MAX_SHARD_SIZE,
            )
        except ValueError as err:  # a --max-shard-size that is no size
            raise CheckpointError(str(err)) from None
        files = len(plan.files)
        print(
            f"wrote {len(plan.weight_map)} tensors ({dtype or 'fp32'}, tied weights once) from {path} to {args.out} "
            f"in {files} file{'s' if files > 1 else ''}{' with model.safetensors.index.json' if files > 1 else ''}"
        )
        return 0
    if dtype not in (None, "fp32") or getattr(args, "max_shard_size", None) is not None:
        raise CheckpointError("export: --dtype and --max-shard-size apply to --format hf; the single file is fp32")
    from slipstream.engine.checkpoint.formats.hf.export import export_fp32

    path, keys = export_fp32(args.dir, args.out, args.tag)
    print(f"wrote {keys} tensors (fp32 weights, every state_dict key) from {path} to {args.out}")
    return 0


def inspect(directory: Path, tag: str | None, verify: bool) -> int:
    path = resolve(directory, tag)
    if path is None:
        print(f"no checkpoint in {directory}")
        return 1
    if path.parent == directory and tag is None:
        latest = latest_tag(directory)
        for other, manifest in complete_checkpoints(directory):
            mark = " <- latest" if other.name == latest else ""
            print(f"  {other.name:<24} step {manifest['global_steps']:>8}{mark}")
    reader = CheckpointReader(path, verify_checksums=verify)
    m = reader.manifest
    if verify:
        from slipstream.engine.checkpoint.verify import verify as verify_all

        verify_all(reader)
    params = m["parameters"]
    numel = sum(_numel(p["shape"]) for p in params.values())
    size = sum(f["bytes"] for f in m["files"].values())
    created = datetime.datetime.fromtimestamp(m["created"], datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    first = next((e for e in reader.rank_meta(0)["slices"] if "optimizer" in e), None)
    common = reader.common()
    print(f"checkpoint      {path}")
    print(
        f"saved           {created} by slipstream {m['slipstream_version']} (torch {m['torch_version']}), format v{m['version']}"
    )
    print(
        f"training        step {m['global_steps']} (micro-step {m['micro_steps']}), {m['world_size']} rank(s), "
        f"ZeRO stage {m['zero_stage']}, {m['precision']}"
    )
    print(f"mesh            {_mesh(m.get('mesh'))}")
    print(
        f"model           {m['module_class']}: {len(params)} parameters, {numel:,} elements; {len(m['buffers'])} buffers"
    )
    print(
        f"state_dict      {len(m['state_dict_keys'])} keys ({len(m['state_dict_keys']) - len(params) - len(m['buffers'])} tied aliases)"
    )
    print(f"optimizer state {', '.join(first['optimizer']) if first else 'none'}")
    pieces = [e for r in range(reader.world_size) for e in reader.rank_meta(r)["slices"]]
    boxed = sum(1 for e in pieces if "box" in e)
    layout = (
        f"{boxed} in boxes ({_boxes(m.get('mesh') or {})})" if boxed else "all whole-tensor boxes (ZeRO flat ranges)"
    )
    print(f"layout          {len(pieces)} saved pieces, {layout}")
    print(f"client_state    {', '.join(_keys(common['client_state'])) or 'empty'}")
    checked = "CRC-32 verified" if verify else "sizes checked (--verify for CRC-32)"
    print(f"files           {len(m['files'])}, {size / 2**20:.1f} MiB, {checked}")
    return 0


def _mesh(mesh: dict[str, int] | None) -> str:
    """The recorded axis sizes, e.g. ``pp 1 × dp 2 × cp 1 × sp 1 × tp 2, ep 1``."""
    if not mesh:
        return "not recorded"
    dense = " × ".join(f"{axis} {size}" for axis, size in mesh.items() if axis != "ep")
    return ", ".join(part for part in (dense, f"ep {mesh['ep']}" if "ep" in mesh else "") if part)


def _boxes(mesh: dict[str, int]) -> str:
    """What the boxes are: tensor parallelism cuts weights into blocks, expert parallelism splits fused expert weights."""
    tp, ep = mesh.get("tp", 1), mesh.get("ep", 1)
    if tp > 1 and ep > 1:
        return f"tensor-parallel blocks (tp {tp}) and expert-parallel slices (ep {ep})"
    if tp > 1:
        return f"tensor-parallel blocks, tp {tp}"
    if ep > 1:
        return f"expert-parallel slices, ep {ep}"
    return "tensor-parallel blocks or expert-parallel slices"


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _keys(tree: object) -> list[str]:
    return [k for k in tree if not k.startswith("__")] if isinstance(tree, dict) else []
