"""``slipstream checkpoint export --format hf``: Hugging Face's sharded layout from a checkpoint's files, and the
one-process side of ``save_sharded`` (file cuts, HF's single-file rule, what a previous save left)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import slipstream
from slipstream.cli import main
from slipstream.engine.checkpoint.formats.hf.files import parse_size
from tests.reference import global_batches, tiny_gpt2

CONFIG = {
    "train_batch_size": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    "zero_optimization": {"stage": 1},
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A checkpoint of a tiny GPT-2 (tied head) after one step, the engine's logits, and its one-process sharded saves."""
    root = tmp_path_factory.mktemp("hf")
    engine = slipstream.initialize(tiny_gpt2(seed=2), CONFIG)
    tokens = global_batches(1, 2, seed=4)[0]
    engine.backward(engine(input_ids=tokens, labels=tokens).loss)
    engine.step()
    engine.save_checkpoint(root / "ckpt")
    with torch.no_grad():
        logits = engine(input_ids=tokens).logits
    saves = root / "saves"
    reports = [engine.weights.save_sharded(saves, max_shard_size=size) for size in ("100KB", "200KB", None)]
    listings = []
    for size in ("100KB", "200KB", None):
        engine.weights.save_sharded(saves, max_shard_size=size)
        listings.append(sorted(p.name for p in saves.iterdir()))
    state = engine.consolidated_state_dict()
    engine.close()
    return {"root": root, "tokens": tokens, "logits": logits, "state": state, "reports": reports, "listings": listings}


def _from_pretrained(directory: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    tiny_gpt2().config.save_pretrained(directory)
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def test_export_format_hf_writes_shards_from_pretrained_loads_with_the_same_logits(
    trained: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors import safe_open

    out = trained["root"] / "export"
    assert (
        main(
            [
                "checkpoint",
                "export",
                "--format",
                "hf",
                "--max-shard-size",
                "100KB",
                str(trained["root"] / "ckpt"),
                str(out),
            ]
        )
        == 0
    )
    assert "with model.safetensors.index.json" in capsys.readouterr().out
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 5 and files == [
        f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)
    ]
    assert set(index["weight_map"]) == {
        n for n, _ in tiny_gpt2().named_parameters()
    }  # tied head once, as save_pretrained
    total = 0
    for name in files:
        assert (out / name).stat().st_size <= 100_000 + 4096  # each file under the cut (plus its header)
        with safe_open(str(out / name), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            total += sum(f.get_tensor(k).nbytes for k in f.keys())
            assert all(
                f.get_tensor(k).dtype == torch.float32 and torch.equal(f.get_tensor(k), trained["state"][k])
                for k in f.keys()
            )
    assert index["metadata"]["total_size"] == total
    model = _from_pretrained(out)
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()  # re-tied on load
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=trained["tokens"]).logits, trained["logits"], rtol=1e-5, atol=1e-5)


def test_export_format_hf_bf16_in_one_file_without_an_index(trained: dict[str, Any]) -> None:
    from safetensors.torch import load_file

    out = trained["root"] / "export-bf16"
    assert (
        main(["checkpoint", "export", "--format", "hf", "--dtype", "bf16", str(trained["root"] / "ckpt"), str(out)])
        == 0
    )
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]  # fits in 5GB: one file, as save_pretrained
    state = load_file(out / "model.safetensors")
    assert all(torch.equal(state[k], trained["state"][k].bfloat16()) for k in state) and len(state) == len(
        trained["state"]
    )


def test_export_refusals_are_one_line(trained: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    ckpt, a_file = str(trained["root"] / "ckpt"), trained["root"] / "a-file"
    a_file.write_text("x")
    assert main(["checkpoint", "export", "--format", "hf", ckpt, str(a_file)]) == 1
    assert "is a file; pass the directory" in capsys.readouterr().err
    assert (
        main(["checkpoint", "export", "--format", "hf", "--max-shard-size", "lots", ckpt, str(trained["root"] / "x")])
        == 1
    )
    assert "max_shard_size: expected bytes or a size such as '5GB'" in capsys.readouterr().err
    assert main(["checkpoint", "export", "--dtype", "bf16", ckpt, str(trained["root"] / "x.safetensors")]) == 1
    assert "--dtype and --max-shard-size apply to --format hf" in capsys.readouterr().err
    assert (
        main(["checkpoint", "export", "--format", "hf", ckpt, str(trained["root"] / "ckpt" / "global_step1" / "hf")])
        == 1
    )
    assert "lies inside the checkpoint" in capsys.readouterr().err


def test_model_save_sharded_in_one_process_cuts_files_and_clears_what_a_previous_save_left(
    trained: dict[str, Any],
) -> None:
    small, medium, whole = trained["reports"]
    assert len(small.files) > len(medium.files) > 1 and whole.files == ["model.safetensors"]
    assert small.received_bytes == small.sent_bytes == 0
    # a new save removes the old save's extra shards and the file that would shadow its index (or the stale index)
    for listing, report in zip(trained["listings"], trained["reports"]):
        expected = report.files + (["model.safetensors.index.json"] if len(report.files) > 1 else [])
        assert listing == sorted(expected)


def test_parse_size_reads_hugging_faces_units() -> None:
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MiB") == 500 * 2**20 and parse_size(1234) == 1234
    assert parse_size("1.5kb") == 1500
    with pytest.raises(ValueError, match="must be positive"):
        parse_size(0)
