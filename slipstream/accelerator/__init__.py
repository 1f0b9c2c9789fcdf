"""Device abstraction. ``get_accelerator()`` picks CUDA when present, else CPU.

``SLIPSTREAM_ACCELERATOR=cpu`` forces the CPU path (useful on a GPU machine for debugging).
"""

from __future__ import annotations

import functools
import os

import torch

from slipstream.accelerator.abstract import Accelerator
from slipstream.accelerator.cpu import CPUAccelerator

__all__ = ["Accelerator", "CPUAccelerator", "get_accelerator"]


@functools.cache
def get_accelerator() -> Accelerator:
    choice = os.environ.get("SLIPSTREAM_ACCELERATOR", "").lower()
    if choice not in ("", "cpu", "cuda"):
        raise ValueError(f"SLIPSTREAM_ACCELERATOR: must be 'cpu' or 'cuda', got {choice!r}")
    if choice == "cuda" or (choice == "" and torch.cuda.is_available()):
        from slipstream.accelerator.cuda import CUDAAccelerator

        return CUDAAccelerator()
    return CPUAccelerator()
