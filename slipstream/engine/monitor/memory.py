"""Deterministic activation-memory measurement: bytes of tensors an operation created that are alive.

Process RSS is noisy (allocator caching, other threads) and CUDA allocator statistics do not exist
on CPU. :class:`LiveTensorMeter` instead watches every operation through a dispatch mode, records
each new storage it produced with a weak reference, and sums the ones still alive after every
operation: exact at operation granularity, the same on every run, and split by device.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveTensorMeter(TorchDispatchMode):
    """Inside ``with LiveTensorMeter() as meter:``, ``meter.live()`` and ``meter.peak`` (bytes by device type).

    Only storages allocated inside the block count (parameters, inputs made before and views of
    them do not).
    """

    def __init__(self, count_meta: bool = False) -> None:
        super().__init__()
        self._skipped = () if count_meta else ("meta",)  # meta storages: a shape-only run (estimator_measure.py)
        self._storages: dict[int, tuple[StorageWeakRef, int, str]] = {}
        self.peak: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # A view or in-place result shares an input's storage: nothing was allocated (and a view of
        # a parameter, such as ``weight.t()``, must not count the parameter as an activation).
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        grew = False
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.device.type not in self._skipped:
                storage = leaf.untyped_storage()
                key = storage._cdata
                if key in inputs:
                    continue
                known = self._storages.get(key)
                if known is None or known[0].expired():
                    self._storages[key] = (StorageWeakRef(storage), storage.nbytes(), leaf.device.type)
                    grew = True
        if not grew:  # frees since the last check only lower the total: the peak cannot move
            return out
        live = self.live()
        for device, nbytes in live.items():
            self.peak[device] = max(self.peak[device], nbytes)
        return out

    def live(self) -> Counter[str]:
        """Bytes by device type of the storages created so far that are still referenced."""
        totals: Counter[str] = Counter()
        for key in [k for k, (ref, _, _) in self._storages.items() if ref.expired()]:
            del self._storages[key]
        for _, nbytes, device in self._storages.values():
            totals[device] += nbytes
        return totals

    def reset_peak(self) -> None:
        self.peak = Counter(self.live())
