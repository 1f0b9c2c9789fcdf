"""Pydantic's validation errors turned into one line per problem: ``key.path: what is wrong, got <value>``."""

from __future__ import annotations

import difflib
import json
import re
from typing import Any, get_args

from pydantic import AliasChoices, BaseModel, ValidationError

from slipstream.engine.config.base import AUTO

# Location parts pydantic adds for union members and validator wrappers ("int", "list[float]",
# "function-after[...]", a model's class name): never part of a key path a user wrote.
_TYPE_TAG = re.compile(r"^(int|float|str|bool|none|[a-z]+\[.*\]|[a-z-]+\[.*|[A-Z]\w*(Config|Params))$")


def key_path(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """``loc`` without pydantic's type tags (list indexes stay)."""
    return tuple(p for p in loc if isinstance(p, int) or not _TYPE_TAG.match(str(p)))


def _section_model(model: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model that holds the key at ``loc`` (for did-you-mean suggestions)."""
    for key in loc:
        field = next((f for name, f in model.model_fields.items() if key == name or key in _aliases(f)), None)
        if field is None:
            return None
        candidates = [field.annotation, *get_args(field.annotation)]
        nested = [c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)]
        if not nested:
            return None
        model = nested[0]
    return model


def _aliases(field: Any) -> list[str]:
    alias = field.validation_alias
    if isinstance(alias, AliasChoices):
        return [a for a in alias.choices if isinstance(a, str)]
    return [alias] if isinstance(alias, str) else []


def known_keys(model: type[BaseModel]) -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        if field.exclude:
            continue
        keys.append(name)
        keys.extend(a for a in _aliases(field) if a != name)
    return keys


def closest_key(key: str, choices: list[str]) -> str | None:
    """The known key ``key`` most likely misspells (case first), or None."""
    same_but_case = [c for c in choices if c.lower() == key.lower()]
    close = same_but_case or difflib.get_close_matches(key, choices, n=1, cutoff=0.6)
    return close[0] if close else None


def did_you_mean(key: str, choices: list[str]) -> str:
    close = closest_key(key, choices)
    return f"; did you mean {close!r}?" if close else f"; known keys: {', '.join(sorted(choices))}"


def _describe_expected(err: dict[str, Any]) -> str:
    kind, ctx = err["type"], err.get("ctx", {})
    if kind == "literal_error":
        return f"must be {ctx.get('expected', '')}"
    if kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        op = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}[kind]
        bound = next(iter(ctx.values()))
        return f"must be {op} {bound}"
    if kind.startswith(("int_", "float_", "bool_", "string_", "dict_", "list_", "tuple_", "model_")):
        expected = {
            "int": "an integer",
            "float": "a number",
            "bool": "true or false",
            "string": "a string",
            "dict": "an object",
            "list": "a list",
            "tuple": "a list",
            "model": "an object",
        }.get(kind.split("_")[0], "")
        return f"must be {expected}" if expected else err["msg"]
    if kind == "finite_number":
        return "must be a finite number"
    msg = err["msg"]
    return msg.removeprefix("Value error, ")


def format_validation_error(
    err: ValidationError, model: type[BaseModel], prefix: str = "", top_level: tuple[str, ...] = ()
) -> str:
    """One line per problem: ``key.path: what is wrong, got <value>``.

    ``top_level`` are the keys of the whole config (with ``prefix`` empty: the keys a top-level
    near miss is compared with); a section name written inside another section is named as such.
    """
    found: dict[str, tuple[str, bool]] = {}  # path -> (line, whether it is one branch of a union)
    required: set[str] = set()  # paths reported as missing
    suggested: set[str] = set()  # paths an unknown key's did-you-mean points to
    for e in err.errors():
        loc = key_path(tuple(e["loc"]))
        path = ".".join(str(p) for p in (prefix.split(".") if prefix else []) + list(loc)) or "config"
        if e["type"] == "extra_forbidden":
            parent = _section_model(model, loc[:-1])
            if prefix == "" and len(loc) == 1:  # a top-level key: compared with every section's name
                choices = known_keys(model) + list(top_level)
            else:
                choices = known_keys(parent) if parent else []
            close = closest_key(str(loc[-1]), choices) if choices else None
            if close is not None:
                suggested.add(path.rsplit(".", 1)[0] + "." + close if "." in path else close)
            hint = did_you_mean(str(loc[-1]), choices) if choices else ""
            if prefix == "" and len(loc) > 1 and str(loc[-1]) in model.model_fields:
                where = ".".join(map(str, loc[:-1]))
                line = f"{path}: {loc[-1]} is a top-level section, not a key of {where}; move it out of {where}"
            else:
                line = f"{path}: unknown key{hint}"
        elif e["type"] == "missing":
            line = f"{path}: is required"
            required.add(path)
        elif e["type"] == "value_error" and (not loc or isinstance(e.get("input"), dict)):
            line = f"{path}: {_describe_expected(e)}"  # a check across keys: the section is the value
        elif e.get("input") == AUTO:
            line = f'{path}: "auto" cannot be resolved here (there is no trainer to fill it in); set a value'
        else:
            line = f"{path}: {_describe_expected(e)}, got {_show(e.get('input'))}"
        found.setdefault(path, (line, len(loc) < len(e["loc"])))
    # A misspelt required key is one mistake, not two: "optimizer.tpe: unknown key; did you mean
    # 'type'?" already says what "optimizer.type: is required" would.
    # A value one union branch refuses as a whole ("must be a number, got [Infinity]") and another
    # refuses inside (the list's element 0): the inner line names the real problem.
    return "\n".join(
        line
        for path, (line, branch) in found.items()
        if not (branch and any(p.startswith(path + ".") for p in found))
        and not (path in suggested and path in required)
    )


def _show(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (dict, list, str, int, float, bool, type(None))) else repr(value)
    return text if len(text) < 80 else text[:77] + "..."
