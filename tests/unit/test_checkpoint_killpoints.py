"""Issue 20: a save killed at each file-system step of its protocol always leaves a loadable ``latest``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_kill_at_every_step_of_the_save_protocol_leaves_a_loadable_checkpoint(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.unit.checkpoint_killpoint_worker", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    kills = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    by_scenario: dict[str, list[dict]] = {}
    for k in kills:
        by_scenario.setdefault(k["scenario"], []).append(k)
    assert len(by_scenario) == 5
    for name, points in by_scenario.items():
        assert len(points) == points[0]["steps"] >= 8, (name, len(points))  # every step, and the protocol has them all
        if name.startswith("existing"):
            assert all(p["loaded"] is not None for p in points)  # 0 unloadable outcomes
        assert points[-1]["global_steps"] in (1, 2)
    print(f"{len(kills)} kill points: " + ", ".join(f"{n} {len(p)}" for n, p in by_scenario.items()))
