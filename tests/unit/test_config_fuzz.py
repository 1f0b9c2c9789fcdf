"""Property-based: a mutated real config either parses or is refused in one line naming a key.

Mutations of the public templates in ``tests/data/configs`` (transformers' and accelerate's
DeepSpeed configs): a value anywhere in the tree replaced by a value of another type or an odd
number (inf, NaN, huge, negative), a key renamed to a near miss, a section replaced by a scalar.
Every outcome must be either a parsed config or a :class:`ConfigError` whose message is one line
and names a key path — never another exception type and never a traceback from inside the engine.
Where the mutated value is non-finite and the parse succeeds, the value must not have reached the
parsed config (numbers are finite or refused). Derandomized, so CI sees the same examples.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from slipstream import ConfigError, load_config

CORPUS = sorted((Path(__file__).resolve().parent.parent / "data" / "configs").rglob("*.json"))
EXAMPLES = 200  # per test; 2 tests
SETTINGS = settings(
    max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), database=None
)

ODD_VALUES = st.sampled_from(
    [
        math.inf,
        -math.inf,
        math.nan,
        1e308,
        -1,
        -1e-9,
        0,
        2**63,
        "",
        "auto",
        "nan",
        "yes",
        None,
        True,
        [],
        {},
        [1, 2],
        {"stage": 9},
        3.5,
        "1e3",
    ]
)


def _paths(tree: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key path of a JSON tree (sections included), in document order."""
    out = []
    if isinstance(tree, dict):
        for key, value in tree.items():
            out.append((*prefix, key))
            out.extend(_paths(value, (*prefix, key)))
    return out


def _set(tree: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


def _rename(tree: dict[str, Any], path: tuple[Any, ...], new_key: str) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[new_key] = tree.pop(path[-1])


def _parse(raw: dict[str, Any]) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_config(raw, world_size=2)


def _check_outcome(raw: dict[str, Any]) -> None:
    try:
        cfg = _parse(raw)
    except ConfigError as err:
        message = str(err)
        assert message and "\n" not in message, f"not one line: {message!r}"
        assert ":" in message, f"names no key: {message!r}"
        assert "Traceback" not in message
        return
    # Parsed: no non-finite number may have reached the config.
    dumped = json.dumps(cfg.model_dump(mode="json"), allow_nan=True)
    assert "NaN" not in dumped and "Infinity" not in dumped.replace('"Infinity"', ""), dumped


def _template(index: int) -> dict[str, Any]:
    return json.loads(CORPUS[index % len(CORPUS)].read_text())


def test_the_corpus_is_there() -> None:
    assert len(CORPUS) >= 10


@SETTINGS
@given(index=st.integers(0, 10_000), where=st.integers(0, 10_000), value=ODD_VALUES)
def test_a_value_of_the_wrong_type_or_range_is_one_line_naming_the_key(index: int, where: int, value: Any) -> None:
    raw = _template(index)
    paths = _paths(raw)
    _set(raw, paths[where % len(paths)], value)
    _check_outcome(raw)


@SETTINGS
@given(
    index=st.integers(0, 10_000),
    where=st.integers(0, 10_000),
    edit=st.sampled_from(["drop", "double", "swap", "upper"]),
)
def test_a_misspelled_key_is_one_line_naming_the_key(index: int, where: int, edit: str) -> None:
    raw = _template(index)
    paths = _paths(raw)
    path = paths[where % len(paths)]
    key = str(path[-1])
    assume(len(key) >= 3)  # too short to misspell
    new = {
        "drop": key[:1] + key[2:],
        "double": key[:2] + key[1:],
        "swap": key[:1] + key[2] + key[1] + key[3:],
        "upper": key.upper(),
    }[edit]
    _rename(raw, path, new)
    _check_outcome(raw)
