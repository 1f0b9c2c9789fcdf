"""How many bytes autograd keeps for backward: the activation memory that sequence, context and
tensor parallelism promise to cut, counted exactly instead of read off a noisy RSS.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


def saved_activation_bytes(run: Callable[[], Any], weights: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the storages autograd saves for backward while ``run()`` executes, each storage once,
    those of ``weights`` (the model's parameters, which are not activations) left out."""
    skip = {w.untyped_storage().data_ptr() for w in weights}
    seen: set[int] = set()
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        key = t.untyped_storage().data_ptr()
        if key not in skip and key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return total
