"""The pieces of the checkpoint format alone: safetensors writer, JSON trees, the async fence, loader position, CLI."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from slipstream.engine.checkpoint.format import decode_tree, encode_tree, file_crc32, write_safetensors
from slipstream.engine.checkpoint.snapshot import GuardedTensors
from slipstream.engine.data import DistributedDataLoader


def test_safetensors_writer_is_read_by_the_official_library(tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    tensors = {
        "w": torch.randn(5, 3),
        "scalar": torch.tensor(2.5),
        "half": torch.randn(7).bfloat16(),
        "ints": torch.arange(4),
        "empty": torch.zeros(0),
        "flags": torch.tensor([True, False]),
    }
    record = write_safetensors(tmp_path / "t.safetensors", tensors, {"note": "x"})
    assert record == {
        "bytes": (tmp_path / "t.safetensors").stat().st_size,
        "crc32": file_crc32(tmp_path / "t.safetensors"),
    }
    loaded = load_file(tmp_path / "t.safetensors")
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())
    with safe_open(str(tmp_path / "t.safetensors"), "pt") as f:
        assert f.metadata() == {"note": "x"}
        assert torch.equal(f.get_slice("w")[1:3], tensors["w"][1:3])


def test_trees_keep_types_and_refuse_what_needs_pickle() -> None:
    tree = {"a": (1, 2.5, "s"), "b": [None, True, torch.ones(2)], 3: {"nested": torch.zeros(1)}}
    tensors: dict[str, torch.Tensor] = {}
    encoded = encode_tree(tree, "x", tensors, "state")
    decoded = decode_tree(encoded, tensors)
    assert (
        decoded["a"] == (1, 2.5, "s")
        and decoded["b"][:2] == [None, True]
        and torch.equal(decoded["b"][2], torch.ones(2))
    )
    assert torch.equal(decoded[3]["nested"], torch.zeros(1))
    with pytest.raises(TypeError, match=r"client_state\['fn'\] is a builtins.function.*without pickle"):
        encode_tree({"fn": lambda: 0}, "c", {}, "client_state")


def test_fence_copies_unwritten_tensors_and_waits_for_the_one_being_written() -> None:
    live = {"a": torch.zeros(1 << 19), "b": torch.zeros(1 << 19)}  # 2 MiB each: not copied up front
    guard = GuardedTensors(live, {}, None)
    started, release, written = threading.Event(), threading.Event(), {}

    def writer() -> None:
        with guard.reading("a") as t:
            started.set()
            release.wait()
            written["a"] = t.clone()
        with guard.reading("b") as t:
            written["b"] = t.clone()

    thread = threading.Thread(target=writer)
    thread.start()
    started.wait()
    fence = threading.Thread(target=guard.fence)
    fence.start()
    fence.join(timeout=0.2)
    assert fence.is_alive()  # "a" is being written from live storage: the fence waits for it
    release.set()
    fence.join()
    for t in live.values():
        t.fill_(7.0)  # the optimizer step changes the weights
    thread.join()
    assert written["a"].eq(0).all() and written["b"].eq(0).all()  # both as of the save


def _epoch_ids(loaders: list[DistributedDataLoader], batches: int | None = None) -> list[int]:
    ids: list[int] = []
    for step in zip(*(iter(loader) for loader in loaders)):
        ids.extend(i for batch in step for i in batch.tolist())
        if batches is not None and len(ids) >= batches * len(loaders) * 2:
            break
    return ids


def test_loader_resumes_mid_epoch_at_another_world_size() -> None:
    data = list(range(48))
    full = _epoch_ids([DistributedDataLoader(data, 2, r, 4) for r in range(4)])  # 4 ranks, one epoch
    first = [DistributedDataLoader(data, 2, r, 4) for r in range(4)]
    seen = _epoch_ids(first, batches=3)  # 24 samples, then "save"
    state = first[0].state_dict()
    assert (state["epoch"], state["samples"]) == (0, 24)
    second = [DistributedDataLoader(data, 2, r, 2) for r in range(2)]
    for loader in second:
        loader.load_state_dict(state)
    rest = _epoch_ids(second)
    assert sorted(seen + rest) == list(range(48)) and sorted(full) == list(range(48))  # nothing repeated or skipped
    assert second[0].state_dict()["epoch"] == 1  # the pass is done: the next iter() starts epoch 1


def test_checkpoint_cli_help_stays_light() -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from slipstream.cli import main\n"
        "try:\n    main(['checkpoint', '--help'])\nexcept SystemExit:\n    pass\n"
        "print('torch imported:', 'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert "inspect" in done.stdout and "export" in done.stdout
    assert "torch imported: False" in done.stdout, done.stdout  # --help never imports torch


def test_a_parameter_not_fully_covered_by_the_saved_slices_is_refused() -> None:
    from slipstream.engine.checkpoint.reader import CheckpointError, check_coverage

    parameters = {"w": {"shape": [4, 3]}, "b": {"shape": [3]}}
    check_coverage("t", parameters, [{"name": "w", "numel": 8}, {"name": "w", "numel": 4}, {"name": "b", "numel": 3}])
    with pytest.raises(CheckpointError, match=r"parameter 'b' has 0 of its 3 elements saved"):
        check_coverage("t", parameters, [{"name": "w", "numel": 12}])
