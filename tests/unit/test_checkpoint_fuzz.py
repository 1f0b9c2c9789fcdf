"""Property-based: a damaged checkpoint either loads exactly or is refused in one line, the engine untouched.

Mutations of a real checkpoint (ZeRO-1, 1 rank, AdamW + WarmupLR, a buffer, client state):
truncation and byte flips of any file (CRCs left stale), and JSON rewrites with consistent CRCs
(a field's type swapped anywhere in the manifest or rank file; a slice entry's start, numel, box
or key rewritten). After each, one long-lived engine loads it: success must give exactly the saved
tensors and counters; failure must be a ``CheckpointError`` (or ``TagError``) with a one-line
message and every piece of the engine as it was. Derandomized, so CI sees the same examples.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slipstream.engine.checkpoint.reader import CheckpointError
from tests.unit.ckpt_helpers import engine, rewrite_json, same, snapshot, train

EXAMPLES = 130  # per test; 4 tests
SETTINGS = settings(
    max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), database=None
)


class _World:
    """One saved checkpoint and one engine, made once for the module (hypothesis runs examples in a loop)."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="slipstream-fuzz-"))
        saver = engine(seed=0)
        train(saver, 3)
        saver.save_checkpoint(self.root / "pristine", tag="t", client_state={"note": "x", "v": torch.arange(3.0)})
        self.saved = snapshot(saver)
        saver.close()
        self.pristine = self.root / "pristine" / "t"
        self.files = sorted(p.name for p in self.pristine.iterdir())
        self.engine = engine(seed=1)
        train(self.engine, 1, seed=4)

    def scratch(self) -> Path:
        target = self.root / "scratch" / "t"
        if target.parent.exists():
            shutil.rmtree(target.parent)
        shutil.copytree(self.pristine, target)
        return target

    def load_and_judge(self) -> str:
        before = snapshot(self.engine)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.engine.load_checkpoint(self.root / "scratch", tag="t")
        except CheckpointError as err:
            message = str(err)
            assert message and "\n" not in message, message
            assert same(snapshot(self.engine), before), f"a failed load changed the engine: {message}"
            return "refused"
        after = snapshot(self.engine)
        for key in self.saved:
            if key not in ("sched",):  # the scheduler's dict holds free-form values a rewrite may legally change
                assert same(after[key], self.saved[key]), f"loaded {key} differs from what was saved"
        return "loaded"


@pytest.fixture(scope="module")
def world() -> _World:
    w = _World()
    yield w
    w.engine.close()
    shutil.rmtree(w.root, ignore_errors=True)


def _paths(tree: Any, prefix: tuple = ()) -> list[tuple]:
    found = [prefix]
    if isinstance(tree, dict):
        for k, v in tree.items():
            found.extend(_paths(v, (*prefix, k)))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            found.extend(_paths(v, (*prefix, i)))
    return found


def _set(tree: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    tree[path[0]] = _set(tree[path[0]], path[1:], value)
    return tree


ODD = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.lists(st.integers(-3, 3), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


@SETTINGS
@given(data=st.data())
def test_truncated_files(world: _World, data: st.DataObject) -> None:
    ckpt = world.scratch()
    name = data.draw(st.sampled_from(world.files))
    size = (ckpt / name).stat().st_size
    cut = data.draw(st.integers(0, max(size - 1, 0)))
    with open(ckpt / name, "r+b") as f:
        f.truncate(cut)
    assert world.load_and_judge() == "refused"


@SETTINGS
@given(data=st.data())
def test_flipped_bytes(world: _World, data: st.DataObject) -> None:
    ckpt = world.scratch()
    name = data.draw(st.sampled_from(world.files))
    raw = bytearray((ckpt / name).read_bytes())
    for _ in range(data.draw(st.integers(1, 3))):
        raw[data.draw(st.integers(0, len(raw) - 1))] ^= data.draw(st.integers(1, 255))
    (ckpt / name).write_bytes(bytes(raw))
    world.load_and_judge()  # a flip inside a JSON string may still parse; the CRC catches the rest


@SETTINGS
@given(data=st.data())
def test_json_fields_of_another_type(world: _World, data: st.DataObject) -> None:
    ckpt = world.scratch()
    name = data.draw(st.sampled_from([n for n in world.files if n.endswith(".json")]))
    tree = json.loads((ckpt / name).read_text())
    path = data.draw(st.sampled_from(_paths(tree)[1:]))
    value = data.draw(ODD)
    rewrite_json(ckpt, name, lambda _: _set(tree, path, value))
    world.load_and_judge()


@SETTINGS
@given(data=st.data())
def test_slice_entries_rewritten_with_consistent_crcs(world: _World, data: st.DataObject) -> None:
    ckpt = world.scratch()
    meta = json.loads((ckpt / "rank00000.json").read_text())
    entry = data.draw(st.sampled_from(meta["slices"]))
    field = data.draw(st.sampled_from(["start", "numel", "box", "key", "name", "shape", "duplicate", "drop"]))
    small = st.integers(-2, 40)
    if field == "box":
        entry["box"] = {
            "offsets": data.draw(st.lists(small, max_size=3)),
            "sizes": data.draw(st.lists(small, max_size=3)),
        }
    elif field == "key":
        entry["key"] = data.draw(st.sampled_from([e["key"] for e in meta["slices"]] + ["missing"]))
    elif field == "name":
        entry["name"] = data.draw(st.sampled_from([e["name"] for e in meta["slices"]] + ["ghost"]))
    elif field == "shape":
        entry["shape"] = data.draw(st.lists(small, max_size=3))
    elif field == "duplicate":
        meta["slices"].append(dict(entry))
    elif field == "drop":
        meta["slices"].remove(entry)
    else:
        entry[field] = data.draw(small)
    rewrite_json(ckpt, "rank00000.json", lambda _: meta)
    world.load_and_judge()
