"""Reading a config: a dict or a ``.json``/``.hjson`` file, and the ``"auto"`` values with a sensible default."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import hjson

from slipstream.engine.config.base import AUTO, ConfigError
from slipstream.utils.logging import get_logger

logger = get_logger(__name__)


def read_config_source(source: dict[str, Any] | str | os.PathLike[str]) -> dict[str, Any]:
    """Return the raw config dict from a dict or a ``.json``/``.hjson`` file (comments allowed)."""
    if isinstance(source, dict):
        return json.loads(json.dumps(source))  # deep copy; also rejects values JSON cannot hold
    path = Path(source)
    if not path.is_file():
        raise ConfigError(f"config: file {str(path)!r} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
        _refuse_yaml(path, text)
        data = hjson.loads(text)
    except hjson.HjsonDecodeError as err:
        raise ConfigError(f"config: {path} is not valid JSON/HJSON: {err}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"config: {path} is not UTF-8 text ({err.reason} at byte {err.start}); save it as UTF-8"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"config: {path} must hold an object at the top level, got {type(data).__name__}")
    return json.loads(json.dumps(data))  # hjson returns OrderedDicts


def _refuse_yaml(path: Path, text: str) -> None:
    """A YAML file parses as HJSON into nonsense (``optimizer: "type: AdamW"``): say what it is instead.

    DeepSpeed configs are JSON; an object starts with ``{``. A file named ``.yaml``/``.yml``, or
    one whose first line is a bare ``key:`` (YAML's mapping; only ``.hjson`` files may leave the
    top-level braces out), is named as YAML.
    """
    lines = (line.strip() for line in text.splitlines())
    first = next((line for line in lines if line and not line.startswith(("#", "//", "/*"))), "")
    bare_key = re.match(r"[A-Za-z_][\w.-]*\s*:", first) is not None
    if path.suffix.lower() in (".yaml", ".yml") or (path.suffix.lower() != ".hjson" and bare_key):
        raise ConfigError(
            f"config: {path} is not a JSON object (it starts with {first[:40]!r}); Slipstream reads DeepSpeed's JSON or "
            "HJSON config files, not YAML: convert it to JSON"
        )


# Paths where "auto" (as written for the HF Trainer) has a sensible resolution without a trainer.
# USE_DEFAULT drops the key, so the default applies exactly as if it were not written.
USE_DEFAULT = object()
_AUTO_DEFAULTS: dict[tuple[str, ...], Any] = {
    ("gradient_clipping",): 1.0,
    ("fp16", "enabled"): False,
    ("bf16", "enabled"): False,
    ("bfloat16", "enabled"): False,
    ("zero_optimization", "reduce_bucket_size"): USE_DEFAULT,
    ("zero_optimization", "allgather_bucket_size"): USE_DEFAULT,
    ("zero_optimization", "stage3_prefetch_bucket_size"): USE_DEFAULT,
    ("zero_optimization", "stage3_param_persistence_threshold"): USE_DEFAULT,
    ("zero_optimization", "prefetch_bucket_size"): USE_DEFAULT,  # DeepSpeed's unprefixed spellings
    ("zero_optimization", "param_persistence_threshold"): USE_DEFAULT,
    ("zero_optimization", "stage3_gather_16bit_weights_on_model_save"): USE_DEFAULT,  # Accelerate's test configs
    ("zero_optimization", "gather_16bit_weights_on_model_save"): USE_DEFAULT,
}


def resolve_auto(raw: dict[str, Any]) -> dict[str, Any]:
    for path, value in _AUTO_DEFAULTS.items():
        node: Any = raw
        for key in path[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict) and node.get(path[-1]) == AUTO:
            if value is USE_DEFAULT:
                del node[path[-1]]
                logger.info('config: %s is "auto"; using the default', ".".join(path))
            else:
                node[path[-1]] = value
                logger.info('config: %s is "auto"; resolved to %r', ".".join(path), value)
    return raw
