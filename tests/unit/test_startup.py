"""Start-up stays cheap: nothing heavy is imported until it is used."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys, time
start = time.perf_counter()
{body}
elapsed = time.perf_counter() - start
heavy = sorted(m for m in ("torch", "transformers", "torch.utils.cpp_extension", "tensorboard", "safetensors") if m in sys.modules)
print(repr((elapsed, heavy)))
"""


def _probe(body: str, preload: str = "") -> tuple[float, list[str]]:
    code = (preload + "\n" if preload else "") + PROBE.format(body=body)
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return eval(out.strip().splitlines()[-1])  # noqa: S307 - our own repr


def test_import_slipstream_does_not_import_torch() -> None:
    _, heavy = _probe("import slipstream")
    assert heavy == []


def test_launcher_help_does_not_import_torch() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys\nfrom slipstream.launcher.cli import main\n"
            "try:\n    main(['run', '--help'])\nexcept SystemExit:\n    pass\nprint('torch' in sys.modules)",
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    assert result.stdout.strip().splitlines()[-1] == "False"


def test_engine_import_cost_beyond_torch_is_small() -> None:
    # Resolving initialize loads the engine, config (pydantic) and comm layers (measured +0.29-0.39 s
    # on the 2-core dev machine: benchmarks/bench_startup.py); what a test can pin without a clock is
    # that nothing heavy comes with them.
    _, heavy = _probe("import slipstream; slipstream.initialize", preload="import torch")
    assert "transformers" not in heavy and "torch.utils.cpp_extension" not in heavy and "tensorboard" not in heavy
