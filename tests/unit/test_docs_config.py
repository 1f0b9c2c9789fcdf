"""docs/config.md must mention every config key the code accepts, so the reference cannot fall behind.

Walks SlipstreamConfig and every nested section model, the optimizer params models and the
scheduler params models, and checks that each field name (and each alias) appears in the doc as
`name` in backticks. Fields with ``exclude=True`` (internal, e.g. ``ignored``) are skipped.
"""

from __future__ import annotations

import re
import types
import typing
from pathlib import Path

import pytest
from pydantic import AliasChoices, BaseModel

from slipstream.engine.config import IGNORED_SECTIONS, SlipstreamConfig
from slipstream.engine.lr_schedules import SCHEDULER_PARAMS
from slipstream.engine.optimizers import OPTIMIZER_PARAMS

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def _nested_models(annotation: object) -> list[type[BaseModel]]:
    """BaseModel subclasses inside an annotation (through Optional, unions, lists, dicts, Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found: list[type[BaseModel]] = []
    if typing.get_origin(annotation) is not None or isinstance(annotation, types.UnionType):
        for arg in typing.get_args(annotation):
            found.extend(_nested_models(arg))
    return found


def _walk(model: type[BaseModel], prefix: str, seen: set[type[BaseModel]]) -> list[tuple[str, str]]:
    """(key path, name to look for) for every documented key of ``model`` and its sections."""
    if model in seen:
        return []
    seen.add(model)
    keys: list[tuple[str, str]] = []
    for name, field in model.model_fields.items():
        if field.exclude:
            continue
        path = f"{prefix}{name}"
        keys.append((path, name))
        alias = field.validation_alias
        aliases = alias.choices if isinstance(alias, AliasChoices) else [alias] if alias else []
        keys.extend((f"{path} (alias)", a) for a in aliases if isinstance(a, str) and a != name)
        for nested in _nested_models(field.annotation):
            keys.extend(_walk(nested, f"{path}.", seen))
    return keys


def _all_keys() -> list[tuple[str, str]]:
    keys = _walk(SlipstreamConfig, "", set())
    for kind, model in OPTIMIZER_PARAMS.items():
        keys.extend(_walk(model, f"optimizer[{kind}].params.", set()))
    for kind, model in SCHEDULER_PARAMS.items():
        keys.append((f"scheduler.type {kind}", kind))
        keys.extend(_walk(model, f"scheduler[{kind}].params.", set()))
    keys.extend((f"ignored section {name}", name) for name in IGNORED_SECTIONS)
    return keys


@pytest.fixture(scope="module")
def documented() -> set[str]:
    assert DOC.is_file(), f"{DOC} is missing"
    return set(re.findall(r"`([^`\n]+)`", DOC.read_text(encoding="utf-8")))


def test_walk_finds_the_sections() -> None:
    # Guard against the walker silently finding nothing (e.g. after a pydantic API change).
    paths = {path for path, _ in _all_keys()}
    for expected in (
        "zero_optimization.stage",
        "zero_optimization.offload_optimizer.device",
        "zero_optimization.offload_param.max_in_cpu",
        "fp16.hysteresis",
        "bf16.check_grad_overflow",
        "aio.intra_op_parallelism (alias)",
        "comms_logger.prof_ops",
        "optimizer[adam].params.adam_w_mode",
        "optimizer[sgd].params.nesterov",
        "scheduler[OneCycle].params.cycle_max_mom",
        "scheduler[WarmupCosineLR].params.last_batch_iteration",
    ):
        assert expected in paths, expected
    assert not any(path == "ignored" or path.startswith("ignored.") for path in paths)


def test_every_config_key_is_documented(documented: set[str]) -> None:
    missing = sorted({f"{path} -> `{name}`" for path, name in _all_keys() if name not in documented})
    assert not missing, "docs/config.md does not mention these keys (as `name` in backticks):\n" + "\n".join(missing)


def test_optimizer_types_are_documented(documented: set[str]) -> None:
    lowered = {d.lower() for d in documented}
    missing = sorted(kind for kind in OPTIMIZER_PARAMS if kind.lower() not in lowered)
    assert not missing, f"docs/config.md does not name these optimizer types: {missing}"
