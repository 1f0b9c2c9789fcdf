"""Issue 20's general promise for checkpoints: every bad input is one line naming the file or key, the value and the fix."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch

from slipstream.engine.checkpoint import format as ckpt_format
from slipstream.engine.checkpoint import writer
from slipstream.engine.checkpoint.reader import CheckpointError
from slipstream.engine.checkpoint.tags import TagError
from tests.unit.ckpt_helpers import eng, engine, rewrite_json, train  # noqa: F401 - eng is a fixture


@pytest.mark.parametrize(
    ("tag", "says"),
    [
        ("x" * 300, "300 characters long"),
        ("two words", "whitespace"),
        (" lead", "whitespace"),
        ("tab\there", "whitespace"),
        (12, "is a int, not a string"),
        (None, None),
        ("", "is empty"),
        (".hidden", "starts with '.'"),
        ("a/b", "path separator"),
        ("latest", "pointer file"),
    ],
)
def test_odd_tags_are_one_line_naming_the_tag_and_the_fix(
    eng: object, tmp_path: Path, tag: object, says: str | None
) -> None:
    if says is None:  # None means the default tag: fine
        assert Path(eng.save_checkpoint(tmp_path, tag=tag)).name == "global_step2"
        return
    with pytest.raises(TagError) as err:
        eng.save_checkpoint(tmp_path, tag=tag)
    message = str(err.value)
    assert "\n" not in message and says in message and "use a plain directory name" in message
    assert not list(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize(
    ("value", "says"), [({1, 2}, "builtins.set"), (object(), "builtins.object"), ({(1, 2): 3}, "key (1, 2)")]
)
def test_unsupported_client_state_values_name_the_key(eng: object, tmp_path: Path, value: object, says: str) -> None:
    with pytest.raises(TypeError) as err:
        eng.save_checkpoint(tmp_path, tag="c", client_state={"bad": value})
    assert "client_state['bad']" in str(err.value) and says in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(TypeError, match="pass a dict"):
        eng.save_checkpoint(tmp_path, tag="c", client_state=[1, 2])


@pytest.mark.parametrize(
    ("file", "field", "value"),
    [
        ("manifest.json", "world_size", "1"),
        ("manifest.json", "files", []),
        ("rank00000.json", "slices", {"a": 1}),
        ("rank00000.json", "stateful", 3),
    ],
)
def test_wrong_typed_json_fields_name_the_file_the_field_and_the_value(
    eng: object, tmp_path: Path, file: str, field: str, value: object
) -> None:
    path = Path(eng.save_checkpoint(tmp_path, tag="j"))
    rewrite_json(path, file, lambda d: {**d, field: value})
    with pytest.raises(CheckpointError) as err:
        eng.load_checkpoint(tmp_path, tag="j")
    message = str(err.value)
    assert "\n" not in message and file in message and field in message and repr(value) in message


def test_non_utf8_files_are_named(eng: object, tmp_path: Path) -> None:
    path = Path(eng.save_checkpoint(tmp_path, tag="u"))
    (path / "manifest.json").write_bytes(b'{"format": "\xff\xfe"}')
    with pytest.raises(CheckpointError, match="manifest.json is not UTF-8"):
        eng.load_checkpoint(tmp_path, tag="u")
    (tmp_path / "latest").write_bytes(b"\xff\xfe")
    with pytest.raises(CheckpointError, match="cannot be read as text"):
        eng.load_checkpoint(tmp_path)


def test_a_second_job_saving_the_same_tag_is_detected_by_the_lock(eng: object, tmp_path: Path) -> None:
    other_job = writer.TagLock(tmp_path, "shared")
    try:
        with pytest.raises(CheckpointError, match="another job is saving tag 'shared'"):
            eng.save_checkpoint(tmp_path, tag="shared")
    finally:
        other_job.release()
    assert Path(eng.save_checkpoint(tmp_path, tag="shared")).is_dir()


def test_a_full_disk_names_the_file_being_written(eng: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = ckpt_format._byte_blocks

    def full(t: torch.Tensor):  # the disk fills up in the middle of the tensor data
        yield from real(t)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt_format, "_byte_blocks", full)
    with pytest.raises(OSError) as err:
        eng.save_checkpoint(tmp_path, tag="full")
    assert err.value.errno == errno.ENOSPC and "rank00000.safetensors" in str(err.value)
    monkeypatch.undo()
    assert json.loads((Path(eng.save_checkpoint(tmp_path, tag="full")) / "manifest.json").read_text())["tag"] == "full"
