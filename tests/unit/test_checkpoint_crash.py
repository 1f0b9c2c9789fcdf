"""Acceptance 3: SIGKILL during saves, 20 times, never leaves a ``latest`` that fails to load or loses the previous checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TRIALS = 20
ROOT = Path(__file__).resolve().parents[2]


def test_killing_a_saving_process_never_breaks_latest(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.unit.checkpoint_crash_worker", str(tmp_path), str(TRIALS), "7"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    trials = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(trials) == TRIALS  # each verified latest (checksums, every tensor) and the last committed checkpoint
    mid_save = [t for t in trials if t["partial"]]
    assert len(mid_save) >= 3, f"only {len(mid_save)} of {TRIALS} kills landed inside a save: the test lost its point"
    steps = [int(t["latest"].removeprefix("global_step")) for t in trials]
    assert steps == sorted(steps)  # every restart resumed from the newest checkpoint (auto_resume) and went on
