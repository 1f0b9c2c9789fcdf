"""What the launcher started, for hosts that guess it: the world size, and whether there is an accelerator.

[Note: the CPU flag nobody mentions] Accelerate and the Trainer treat a CPU machine as one process
unless told ``cpu=True`` / ``--use_cpu`` / ``ACCELERATE_USE_CPU=1``, even when ``slipstream run``
(or torchrun) started several: every rank then fills the config's ``"auto"`` batch sizes for a
world of 1 and the engine refuses the triad. Slipstream trains on the CPU there anyway, so the
switch sets that flag itself when the launcher's ``WORLD_SIZE`` is above 1 and no accelerator is
present; and a host that still sees another world size is refused with the cause named.
"""

from __future__ import annotations

import os

from slipstream.accelerator import get_accelerator


def launched_world_size() -> int | None:
    """``WORLD_SIZE`` as the launcher set it (None when not launched, or not a number)."""
    value = os.environ.get("WORLD_SIZE", "")
    return int(value) if value.isascii() and value.isdigit() and len(value) < 10 else None


def host_needs_cpu_flag() -> bool:
    """Several processes launched on a machine without an accelerator: the host must be told it runs on CPU."""
    world = launched_world_size()
    return world is not None and world > 1 and get_accelerator().name == "cpu"


def check_host_world_size(host: str, seen: int) -> None:
    """Refuse a host that counts another number of processes than the launcher started (the batch triad would be wrong)."""
    world = launched_world_size()
    if world is not None and seen != world:
        raise ValueError(
            f"{host} sees {seen} process(es) but the launcher started WORLD_SIZE={world}; on a machine without GPUs "
            "pass --use_cpu (TrainingArguments(use_cpu=True)) or Accelerator(cpu=True) / ACCELERATE_USE_CPU=1, so the "
            '"auto" batch sizes count every process'
        )
