"""Find the tensors inside whatever a module returns: tuples, lists, dicts, dataclasses, ModelOutput."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any


def tensors_in(value: Any) -> Iterator[Any]:
    import torch

    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):  # dict, OrderedDict, transformers' ModelOutput
        for item in value.values():
            yield from tensors_in(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from tensors_in(getattr(value, field.name))
