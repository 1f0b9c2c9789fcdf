"""CUDA: real streams and events, handed to the communication context (comm/context.py), the only code that makes them."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from slipstream.accelerator.abstract import Accelerator


class CUDAAccelerator(Accelerator):
    name = "cuda"
    communication_backend = "nccl"

    def device(self, index: int | None = None) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device() if index is None else index)

    def set_device(self, index: int) -> None:
        torch.cuda.set_device(index)

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def device_name(self) -> str:
        return torch.cuda.get_device_name()

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream()

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream()

    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def new_event(self) -> torch.cuda.Event:
        return torch.cuda.Event()

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory()

    def pinned_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, pin_memory=True)  # page-aligned: also O_DIRECT-ready

    def memory_allocated(self) -> int:
        return torch.cuda.memory_allocated()

    def max_memory_allocated(self) -> int:
        return torch.cuda.max_memory_allocated()

    def free_memory(self) -> int:
        free, _ = torch.cuda.mem_get_info()
        return int(
            free + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
        )  # the caching allocator's idle blocks too

    def reset_peak_memory_stats(self) -> None:
        torch.cuda.reset_peak_memory_stats()

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)
        torch.cuda.manual_seed_all(seed)

    def rng_state(self) -> torch.Tensor | None:
        return torch.cuda.get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        torch.cuda.set_rng_state(state.cpu())
