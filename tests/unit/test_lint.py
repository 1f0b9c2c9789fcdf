"""The repository stays formatted and lint-clean: ``ruff format --check`` and ``ruff check`` with ``ruff.toml``.

The ruff version is pinned in setup.py's dev extra (and so in requirements/constraints.txt): another
release formats differently, and this test would then fail on code nobody touched.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _ruff() -> list[str]:
    beside = Path(sys.executable).with_name("ruff")  # the venv's own, whatever PATH says
    if beside.is_file():
        return [str(beside)]
    found = shutil.which("ruff")
    if found is None:
        pytest.fail("ruff is not installed: scripts/setup.sh installs it with the dev extra")
    return [found]


@pytest.mark.parametrize("command", [["format", "--check"], ["check"]], ids=["format", "check"])
def test_ruff_is_clean(command: list[str]) -> None:
    done = subprocess.run([*_ruff(), *command, "."], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"ruff {' '.join(command)} found:\n{done.stdout[-4000:]}{done.stderr[-2000:]}"
