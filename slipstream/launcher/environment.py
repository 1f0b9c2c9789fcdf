"""The environment a multi-node job carries to its other nodes.

ssh and pdsh start remote commands with the remote login environment, not ours, so the launcher
passes along what a training job depends on: variables whose names start with one of
:data:`EXPORT_PREFIXES` (NCCL and CUDA tuning, ``PYTHONPATH``, OpenMP threads, our own knobs),
then the ``KEY=VALUE`` lines of ``.slipstream_env`` in the home directory and then in the current
directory (later wins: the job's own file overrides the user-wide one).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from slipstream.errors import SlipstreamError
from slipstream.launcher.textfile import read_small_text
from slipstream.launcher.usage import shown

EXPORT_PREFIXES = ("NCCL_", "PYTHON", "CUDA_", "OMP_", "SLIPSTREAM_", "TORCH_NCCL_", "UCX_", "FI_")
ENV_FILE = ".slipstream_env"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class EnvFileError(SlipstreamError, ValueError):
    """A line of ``.slipstream_env`` that is not ``KEY=VALUE``."""


def parse_env_file(text: str, source: str) -> dict[str, str]:
    values: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export ") :].lstrip()
        key, sep, value = line.partition("=")
        key = key.strip()
        if not sep or not _NAME.fullmatch(key):
            raise EnvFileError(
                f"{source} line {number}: expected KEY=VALUE, got {shown(raw.strip())}; write one "
                "variable per line (a name of letters, digits and '_'), or start a comment with #"
            )
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        if "\0" in value:  # the exec of the remote command would fail with a traceback
            raise EnvFileError(f"{source} line {number}: the value of {key} contains a NUL byte; remove it")
        values[key] = value
    return values


def exported_env(environ: Mapping[str, str], cwd: str, home: str | None) -> dict[str, str]:
    """Variables to set on every node, in a stable order (sorted names, then file order)."""
    values = {key: environ[key] for key in sorted(environ) if key.startswith(EXPORT_PREFIXES) and _NAME.fullmatch(key)}
    directories = [home, cwd] if home and os.path.abspath(home) != os.path.abspath(cwd) else [cwd]
    for directory in directories:
        path = os.path.join(directory, ENV_FILE)
        if os.path.exists(path):
            values.update(parse_env_file(read_small_text(path, ENV_FILE, EnvFileError), path))
    return values
