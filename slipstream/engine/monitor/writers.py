"""Metric writers for the ``tensorboard``, ``csv_monitor`` and ``wandb`` sections (rank 0 only).

Event names and the x axis follow DeepSpeed (``Train/Samples/train_loss`` against the number of
samples trained), so dashboards built for DeepSpeed runs read ours unchanged.
"""

from __future__ import annotations

import csv
import os
import re
from pathlib import Path
from typing import Any, Protocol

from slipstream.engine.config import ConfigError, SlipstreamConfig


class Writer(Protocol):
    def write(self, events: list[tuple[str, float, int]]) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


class TensorBoardWriter:
    """``<output_path or ./runs>/<job_name>``: one event file, read with TensorBoard."""

    def __init__(self, output_path: str, job_name: str) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError("tensorboard.enabled: needs the tensorboard package; pip install tensorboard") from None
        self.log_dir = Path(output_path or "runs") / job_name
        self._writer = SummaryWriter(log_dir=str(self.log_dir))

    def write(self, events: list[tuple[str, float, int]]) -> None:
        for name, value, x in events:
            self._writer.add_scalar(name, value, x)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class CSVWriter:
    """``<output_path or ./csv_monitor>/<job_name>/<event>.csv`` with ``step,<event>`` rows (DeepSpeed's layout)."""

    def __init__(self, output_path: str, job_name: str) -> None:
        self.log_dir = Path(output_path or "csv_monitor") / job_name
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._files: dict[str, Any] = {}

    def path(self, name: str) -> Path:
        return self.log_dir / (re.sub(r"[^A-Za-z0-9_.-]+", "_", name) + ".csv")

    def write(self, events: list[tuple[str, float, int]]) -> None:
        for name, value, x in events:
            handle = self._files.get(name)
            if handle is None:
                path = self.path(name)
                new = not path.exists()
                handle = self._files[name] = open(path, "a", newline="")  # noqa: SIM115 - kept open for the run
                if new:
                    csv.writer(handle).writerow(["step", name])
            csv.writer(handle).writerow([x, repr(float(value))])

    def flush(self) -> None:
        for handle in self._files.values():
            handle.flush()

    def close(self) -> None:
        for handle in self._files.values():
            handle.close()
        self._files = {}


class WandbWriter:
    """Weights & Biases, offline unless ``WANDB_MODE`` says otherwise (``wandb sync`` uploads later)."""

    def __init__(self, project: str, group: str | None, team: str | None, config: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError:
            raise ConfigError(
                "wandb.enabled: the wandb package is not installed; pip install wandb, or set enabled to false"
            ) from None
        self._wandb = wandb
        self._run = wandb.init(
            project=project, group=group, entity=team, config=config, mode=os.environ.get("WANDB_MODE", "offline")
        )

    def write(self, events: list[tuple[str, float, int]]) -> None:
        if events:
            self._run.log({name: value for name, value, _ in events}, step=events[0][2])

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self._run.finish()


def build_writers(config: SlipstreamConfig) -> list[Writer]:
    """The enabled writers (call on the rank that writes); a missing package is a ConfigError."""
    writers: list[Writer] = []
    if config.tensorboard.enabled:
        writers.append(TensorBoardWriter(config.tensorboard.output_path, config.tensorboard.job_name))
    if config.csv_monitor.enabled:
        writers.append(CSVWriter(config.csv_monitor.output_path, config.csv_monitor.job_name))
    if config.wandb.enabled:
        writers.append(
            WandbWriter(config.wandb.project, config.wandb.group, config.wandb.team, config.model_dump(mode="json"))
        )
    return writers
