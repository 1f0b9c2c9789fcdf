"""Every random generator a resumed run must continue: Python's, NumPy's, torch's CPU one and the device's."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch


class RngState:
    """A ``Stateful`` over the process-global generators; the device's through the accelerator's two hooks."""

    def __init__(
        self, device_get: Callable[[], torch.Tensor | None], device_set: Callable[[torch.Tensor], None]
    ) -> None:
        self._device_get, self._device_set = device_get, device_set

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = random.getstate()
        state: dict[str, Any] = {"python": [version, list(internal), gauss], "torch": torch.get_rng_state()}
        try:
            import numpy
        except ImportError:  # pragma: no cover - numpy is optional
            numpy = None
        if numpy is not None:
            name, keys, pos, has_gauss, cached = numpy.random.get_state()
            state["numpy"] = [name, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached]
        device = self._device_get()
        if device is not None:
            state["device"] = device
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        torch.set_rng_state(state["torch"])
        if "numpy" in state:
            import numpy

            name, keys, pos, has_gauss, cached = state["numpy"]
            numpy.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, cached))
        if "device" in state:
            self._device_set(state["device"])
