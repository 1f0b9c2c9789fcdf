"""Finding a DeepSpeed checkpoint and reading what describes it: stage, world size, files, names and shapes.

[Note: the layouts read] DeepSpeed 0.14-0.19 writes ``<save_dir>/<tag>/`` (``latest`` names the
tag; the HF Trainer's ``checkpoint-N/`` holds such a save directory) with:

- ``mp_rank_00_model_states.pt`` (ZeRO 0-2) or ``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` (ZeRO-3,
  one per rank): the module's state dict (16-bit or fp32 weights; at ZeRO-3 only buffers are
  real), ``param_shapes`` (the names and shapes of the flattened fp32 groups, in their order),
  ``shared_params`` (tied aliases), ``lr_scheduler``, the step counters, ``ds_config`` and the
  caller's ``client_state`` merged in at top level;
- ``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt``, one per data-parallel rank: the rank's
  fp32 partition of each group and the torch optimizer's state of it, or at ZeRO 0 the whole
  optimizer state inside the model-states file.

A universal checkpoint (``ds_to_universal``; ``latest_universal`` names it) holds
``zero/<parameter>/{fp32,exp_avg,exp_avg_sq,step}.pt`` with each whole tensor, plus the model states.
Tensor- or pipeline-parallel and MoE checkpoints (``mp_rank_01``, ``layer_*``, ``expert_*`` files)
are refused by name.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from pathlib import Path
from typing import Any

import torch

from slipstream.engine.checkpoint.formats.deepspeed.unpickle import attributes, load_pickle
from slipstream.engine.checkpoint.validate import CheckpointError

_OPTIM = re.compile(r"^(bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_MODEL3 = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
MODEL_FILE = "mp_rank_00_model_states.pt"
LATEST_FILES = ("latest", "latest_universal")

# Keys DeepSpeed's engine writes into the model-states file; the rest are the caller's client_state.
ENGINE_KEYS = frozenset(
    {
        "module",
        "buffer_names",
        "optimizer",
        "param_shapes",
        "frozen_param_shapes",
        "shared_params",
        "frozen_param_fragments",
        "lr_scheduler",
        "data_sampler",
        "random_ltd",
        "sparse_tensor_module_names",
        "skipped_steps",
        "global_steps",
        "global_samples",
        "dp_world_size",
        "mp_world_size",
        "ds_config",
        "ds_version",
        "universal_checkpoint_info",
        "checkpoint_parallel_dimensions",
        "pp_degree",
        "tp_degree",
        "iteration",
        "ds_autotp_universal_checkpoint_meta",
    }
)


def _is_checkpoint_dir(path: Path) -> bool:
    if not path.is_dir():
        return False
    if (path / MODEL_FILE).is_file():  # universal checkpoints carry it too (a bare "zero" folder may be a tag of ours)
        return True
    return any(_MODEL3.match(p.name) for p in path.iterdir())


def locate(load_dir: str | Path, tag: str | None) -> Path | None:
    """The DeepSpeed checkpoint directory ``load_dir`` (with ``tag``, or ``latest``) points to, else None.

    None means "not a DeepSpeed checkpoint": the caller goes on to its own format and its own errors.
    """
    root = Path(load_dir)
    if tag is not None:
        return root / tag if _is_checkpoint_dir(root / tag) else None
    if _is_checkpoint_dir(root):
        return root
    for name in LATEST_FILES:
        file = root / name
        if file.is_file():
            try:
                pointed = file.read_text(encoding="utf-8").strip()
            except (OSError, UnicodeDecodeError):
                continue
            if pointed and "/" not in pointed and pointed not in (".", "..") and _is_checkpoint_dir(root / pointed):
                return root / pointed
    return None


@dataclasses.dataclass
class DeepSpeedCheckpoint:
    """One DeepSpeed checkpoint directory, described from its model-states file and file names."""

    path: Path
    model_state: dict[str, Any]  # rank 0's model-states file
    zero_stage: int
    world: int  # data-parallel partitions
    precision: str
    optim_files: list[Path]  # by data-parallel rank; empty at ZeRO 0 and for universal checkpoints
    universal: bool

    @property
    def version(self) -> str:
        return str(self.model_state.get("ds_version", "unknown"))

    @property
    def config(self) -> dict[str, Any]:
        config = self.model_state.get("ds_config")
        return config if isinstance(config, dict) else {}

    def param_shapes(self) -> list[dict[str, tuple[int, ...]]]:
        """Per flat group, the parameter names and shapes in their flattened order."""
        groups = self.model_state.get("param_shapes")
        if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
            raise CheckpointError(
                f"DeepSpeed checkpoint {self.path}: {MODEL_FILE} has no param_shapes (written by ZeRO 0, or damaged)"
            )
        return [{str(n): tuple(int(d) for d in s) for n, s in g.items()} for g in groups]

    def merged_param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every flat group's names and shapes, in order, as one dict (empty when none are recorded, as at ZeRO 0)."""
        return (
            {n: s for group in self.param_shapes() for n, s in group.items()}
            if self.model_state.get("param_shapes")
            else {}
        )

    def module_params(self) -> list[str]:
        """Parameter names of the module state dict in order: not buffers, not tied aliases, each tied tensor once."""
        module = self.model_state["module"]
        buffers, shared = set(self.buffer_names()), self.shared_params()
        seen: set[tuple[int, int]] = set()
        names = []
        for key, value in module.items():
            if key in buffers or key in shared or not torch.is_tensor(value):
                continue
            ident = (value.untyped_storage().data_ptr(), value.storage_offset())
            if value.numel() and ident in seen:
                continue
            seen.add(ident)
            names.append(key)
        return names

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's shape: the recorded flat groups', else the module state dict's."""
        module = self.model_state["module"]
        return self.merged_param_shapes() or {n: tuple(module[n].shape) for n in self.module_params()}

    @functools.cached_property
    def optimizer_globals(self) -> dict[str, Any]:
        """What every rank's optimizer state shares, read once: the torch ``param_groups``, the loss scaler, and
        the step a universal checkpoint keeps in ``zero/optimizer_state.pt`` (ZeRO-3's has no per-parameter step.pt)."""
        inner: Any = None
        saved = self.model_state.get("optimizer")
        scaler = saved.get("loss_scaler") if isinstance(saved, dict) else None
        groups = saved.get("param_groups") if isinstance(saved, dict) else None
        if self.universal:
            file = self.path / "zero" / "optimizer_state.pt"
            found = load_pickle(file) if file.is_file() else None
            groups = found.get("param_groups") if isinstance(found, dict) else None
            inner = found.get("optimizer_state_dict") if isinstance(found, dict) else None
        elif self.optim_files:
            opt = load_pickle(self.optim_files[0]).get("optimizer_state_dict", {})
            scaler = opt.get("loss_scaler")
            base = opt.get("optimizer_state_dict") or opt.get("base_optimizer_state")
            groups = base.get("param_groups") if isinstance(base, dict) else None
        state = inner.get("state") if isinstance(inner, dict) else None
        first = next(iter(state.values()), None) if isinstance(state, dict) and state else None
        step = first.get("step") if isinstance(first, dict) else None
        if isinstance(step, (int, float)) or torch.is_tensor(step):
            step = torch.as_tensor(step, dtype=torch.float32).reshape(())
        else:
            step = None
        return {"param_groups": groups if isinstance(groups, list) else [], "loss_scaler": scaler, "step": step}

    def shared_params(self) -> dict[str, str]:
        shared = self.model_state.get("shared_params") or {}
        return {str(k): str(v) for k, v in shared.items()} if isinstance(shared, dict) else {}

    def buffer_names(self) -> list[str]:
        return [str(n) for n in self.model_state.get("buffer_names") or []]

    def counters(self) -> dict[str, int]:
        config = self.config
        micro = int(config.get("train_micro_batch_size_per_gpu") or 1)
        gas = config.get("gradient_accumulation_steps")
        if not isinstance(gas, int) or gas < 1:
            batch = config.get("train_batch_size")
            gas = max(1, int(batch) // (micro * self.world)) if isinstance(batch, int) else 1
        steps = int(self.model_state.get("global_steps") or 0)
        return {
            "global_steps": steps,
            "micro_steps": steps * gas,
            "global_samples": int(self.model_state.get("global_samples") or 0),
            "skipped_steps": int(self.model_state.get("skipped_steps") or 0),
            "gradient_accumulation_steps": gas,
        }

    def client_state(self) -> dict[str, Any]:
        return {k: v for k, v in self.model_state.items() if isinstance(k, str) and k not in ENGINE_KEYS}

    def loss_scaler(self, saved: Any) -> dict[str, Any]:
        """Our loss scaler's state from DeepSpeed's (a LossScaler/DynamicLossScaler object): empty unless fp16."""
        if self.precision != "fp16":
            return {}
        found = attributes(saved)
        if not found:
            return {}
        if "cur_hysteresis" in found or found.get("dynamic"):
            return {
                "scale": float(found.get("cur_scale", 1.0)),
                "iteration": int(found.get("cur_iter", 0)),
                "last_overflow_iteration": int(found.get("last_overflow_iter", -1)),
                "remaining_hysteresis": int(found.get("cur_hysteresis", 1)),
            }
        return {"scale": float(found.get("cur_scale", 1.0))}


def describe(path: Path) -> DeepSpeedCheckpoint:
    """Read the model-states file and list the optimizer files of the DeepSpeed checkpoint at ``path``."""
    names = sorted(p.name for p in path.iterdir())
    _refuse_parallel(path, names)
    universal = (path / "zero" / "optimizer_state.pt").is_file()
    optim: dict[int, Path] = {}
    for name in names:
        found = _OPTIM.match(name)
        if found:
            optim[int(found.group(2))] = path / name
    model_file = path / MODEL_FILE
    if not model_file.is_file():
        ranks = sorted(int(m.group(1)) for m in map(_MODEL3.match, names) if m)
        if not ranks:
            raise CheckpointError(f"DeepSpeed checkpoint {path} has no {MODEL_FILE} nor zero_pp_rank_*_model_states.pt")
        model_file = path / f"zero_pp_rank_{ranks[0]}_mp_rank_00_model_states.pt"
    model_state = load_pickle(model_file)
    if not isinstance(model_state, dict) or "module" not in model_state:
        raise CheckpointError(
            f"DeepSpeed checkpoint {path}: {model_file.name} holds no 'module' state (not a DeepSpeed model-states file)"
        )
    if not model_state.get("param_shapes") and not any(
        torch.is_tensor(v) and v.numel() for v in model_state["module"].values()
    ):
        raise CheckpointError(
            f"DeepSpeed checkpoint {path}: {model_file.name} holds no weights (an empty module state and no param_shapes)"
        )
    mp = model_state.get("mp_world_size", 1)
    if isinstance(mp, int) and mp > 1:
        raise CheckpointError(
            f"DeepSpeed checkpoint {path} was written with model parallelism (mp_world_size {mp}); slipstream reads "
            "data-parallel DeepSpeed checkpoints: convert it with DeepSpeed's ds_to_universal first"
        )
    config = model_state.get("ds_config") if isinstance(model_state.get("ds_config"), dict) else {}
    precision = (
        "bf16"
        if _enabled(config, "bf16") or _enabled(config, "bfloat16")
        else "fp16"
        if _enabled(config, "fp16")
        else "fp32"
    )
    if universal:
        return DeepSpeedCheckpoint(path, model_state, _stage(config), 1, precision, [], True)
    if sorted(optim) != list(range(len(optim))):
        raise CheckpointError(
            f"DeepSpeed checkpoint {path}: optimizer files for ranks {sorted(optim)}; some ranks' files are missing"
        )
    stage = _stage(config)
    world = len(optim) if optim else int(model_state.get("dp_world_size") or 1)
    recorded = model_state.get("dp_world_size")
    if optim and stage > 0 and isinstance(recorded, int) and recorded != len(optim):
        raise CheckpointError(
            f"DeepSpeed checkpoint {path} was written by {recorded} data-parallel ranks but holds {len(optim)} optimizer "
            "files (an overwritten or incomplete save)"
        )
    return DeepSpeedCheckpoint(path, model_state, stage, world, precision, [optim[r] for r in sorted(optim)], False)


def _enabled(config: dict[str, Any], key: str) -> bool:
    section = config.get(key)
    return isinstance(section, dict) and bool(section.get("enabled", False))


def _stage(config: dict[str, Any]) -> int:
    zero = config.get("zero_optimization")
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    return int(stage) if isinstance(stage, (int, float)) else 0


def _refuse_parallel(path: Path, names: list[str]) -> None:
    for name in names:
        if (
            name.startswith("layer_")
            or "expert_" in name
            or re.match(r"^(zero_pp_rank_\d+_)?mp_rank_(0[1-9]|[1-9]\d)", name)
        ):
            what = (
                "pipeline-parallel layers"
                if name.startswith("layer_")
                else "MoE experts"
                if "expert_" in name
                else "tensor parallelism"
            )
            raise CheckpointError(
                f"DeepSpeed checkpoint {path} holds {name} ({what}); slipstream reads data-parallel DeepSpeed checkpoints "
                "(ZeRO 0-3) and universal ones: convert it with DeepSpeed's ds_to_universal first"
            )


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)
