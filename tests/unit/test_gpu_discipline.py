"""GPU discipline checked on the source: strategies and collectives never touch ``torch.cuda``.

The accelerator wraps CUDA; the communication context (``comm/context.py``) is the only code that
makes streams and events. A strategy calling ``torch.cuda`` directly, or making its own stream,
would escape the ordering the recording-accelerator tests pin (``tests/distributed/test_comm_order.py``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "slipstream"
NO_CUDA = ["comm", "engine"]  # every strategy, collective, parallelism, the engine and its monitor
STREAM_MAKERS = {"new_stream", "new_event"}


def _files(*parts: str) -> list[Path]:
    return sorted(p for part in parts for p in (SRC / part).rglob("*.py"))


def _cuda_uses(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr == "cuda"
            and isinstance(node.value, ast.Name)
            and node.value.id == "torch"
        ):
            lines.append(node.lineno)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            )
            if any(n == "torch.cuda" or n.startswith("torch.cuda.") for n in names):
                lines.append(node.lineno)
    return lines


@pytest.mark.parametrize("path", _files(*NO_CUDA), ids=lambda p: str(p.relative_to(SRC)))
def test_no_torch_cuda_outside_the_accelerator(path: Path) -> None:
    uses = _cuda_uses(ast.parse(path.read_text(), str(path)))
    assert not uses, (
        f"{path.relative_to(SRC)} lines {uses}: use slipstream.accelerator (or the communication context) instead of torch.cuda"
    )


def test_only_the_context_makes_streams_and_events() -> None:
    offenders = []
    for path in _files("comm", "engine", "ops", "integrations"):
        if path == SRC / "comm" / "context.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in STREAM_MAKERS:
                offenders.append(f"{path.relative_to(SRC)}:{node.lineno}")
            if (
                isinstance(node, ast.Attribute)
                and node.attr in ("Stream", "Event")
                and isinstance(node.value, ast.Attribute)
                and node.value.attr == "cuda"
            ):
                offenders.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert not offenders, f"streams or events made outside comm/context.py: {offenders}"


def test_the_checks_catch_a_violation() -> None:
    assert _cuda_uses(ast.parse("import torch\ntorch.cuda.synchronize()\n")) == [2]
    assert _cuda_uses(ast.parse("from torch.cuda import Stream\n")) == [1]
    assert _cuda_uses(ast.parse("import torch\ntorch.cuda_like = 1\n")) == []
