"""Hugging Face safetensors shards written by every rank (ZeRO 0, 2, 3 and tensor parallel at world 2): each rank
writes its own file, nothing is gathered, and ``from_pretrained`` reproduces the engine's logits."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import slipstream
from slipstream.engine.model_save import ModelWeights
from tests.distributed import tp_cases
from tests.harness import run_distributed
from tests.reference import global_batches, tiny_gpt2

FILES = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
INDEX = "model.safetensors.index.json"


def _build(case: str) -> tuple[torch.nn.Module, dict[str, Any]]:
    if case == "tp2":  # tensor parallel 2, dp 1: split weights in boxes, norms replicated
        return tp_cases.llama(seed=3, n_layer=2), tp_cases.config(micro=2, dp=1, tp=2, stage=0)
    stage = {"zero0": 0, "zero2-bf16": 2, "zero3": 3}[case]
    model = tiny_gpt2(seed=3)
    if case == "zero0":
        model.register_buffer("marker", torch.arange(4.0))  # a persistent buffer: written once, by rank 0
    if case == "zero3":
        model.transformer.wpe.weight.requires_grad_(False)  # a frozen parameter (left out on request)
    config = {
        "train_batch_size": 4,
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 20_000},
    }
    if case == "zero2-bf16":
        config["bf16"] = {"enabled": True}
    return model, config


@contextlib.contextmanager
def _no_whole_model_gather(engine: Any) -> Iterator[None]:
    """Every path that assembles the whole model on one rank raises while the sharded save runs."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the sharded save gathered the whole model")

    saved = {name: getattr(ModelWeights, name) for name in ("consolidated", "gather_spread", "full_state")}
    for name in saved:
        setattr(ModelWeights, name, refuse)
    engine.strategy.consolidated_state_dict = refuse
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(ModelWeights, name, method)
        del engine.strategy.consolidated_state_dict


def _full_disk_on_rank_1(engine: Any, directory: Path) -> str:
    """Rank 1's file write fails: every rank raises the same error (none hangs), and no index is written."""
    from slipstream.engine.checkpoint.formats.hf import files as hf_shards

    write = hf_shards.write_file

    def fail(path: Path, *args: Any) -> None:
        raise OSError(28, "No space left on device", str(path))

    hf_shards.write_file = fail if dist.get_rank() == 1 else write
    try:
        engine.weights.save_sharded(directory)
    except OSError as err:
        return str(err)
    finally:
        hf_shards.write_file = write
    return "no error"


def _body(case: str, root: str) -> dict[str, Any]:
    rank = dist.get_rank()
    model, config = _build(case)
    engine = slipstream.initialize(model, config)
    tokens = global_batches(1, 2, seed=11)[0]
    engine.backward(engine(input_ids=tokens, labels=tokens).loss)
    engine.step()  # the masters moved away from the initial weights
    out = Path(root)
    with _no_whole_model_gather(engine):
        assert engine.save_16bit_model(out / "default", "model.safetensors")  # sharded: world 2, a .safetensors name
        report = engine.weights.save_sharded(out / "report")
        extra = {}
        if case == "zero2-bf16":
            extra["fp32"] = engine.weights.save_sharded(out / "fp32", torch.float32).files
        if case == "zero3":
            extra["small"] = engine.weights.save_sharded(out / "small", max_shard_size=report.total_bytes // 6).files
            extra["frozen"] = engine.weights.save_sharded(out / "frozen", exclude_frozen=True).weight_map
    if case == "zero0":  # the one-file path still answers sharded=False
        assert engine.save_16bit_model(out / "single", "model.safetensors", sharded=False)
        extra["full_disk"] = _full_disk_on_rank_1(engine, out / "full")
    with torch.no_grad():
        logits = engine(input_ids=tokens).logits.float()
    state = engine.consolidated_state_dict()
    engine.close()
    return {
        "files": report.files,
        "peak": report.peak_bytes,
        "total": report.total_bytes,
        "received": report.received_bytes,
        "largest": max(p.numel() for p in _build(case)[0].parameters()) * engine.training_dtype.itemsize,
        "logits": logits,
        "tokens": tokens,
        "state": state if rank == 0 else None,
        "extra": extra,
        "dtype": engine.training_dtype,
    }


def _load(directory: Path, model: torch.nn.Module) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model.config.save_pretrained(directory)
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def _check_layout(directory: Path, expected_keys: set[str], files: list[str]) -> dict[str, str]:
    index = json.loads((directory / INDEX).read_text())
    assert set(index["weight_map"]) == expected_keys
    assert sorted(set(index["weight_map"].values())) == sorted(files)
    assert sorted(p.name for p in directory.glob("*.safetensors*")) == sorted(files + [INDEX])  # no .part left behind
    from safetensors import safe_open

    size = 0
    for name in files:
        with safe_open(str(directory / name), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            assert {k for k, v in index["weight_map"].items() if v == name} == set(f.keys())
            size += sum(f.get_tensor(k).nbytes for k in f.keys())
    assert index["metadata"]["total_size"] == size
    return index["weight_map"]


@pytest.mark.parametrize("case", ["zero0", "zero2-bf16", "zero3", "tp2"])
def test_every_rank_writes_its_shard_and_from_pretrained_reproduces_the_logits(case: str, tmp_path: Path) -> None:
    results = run_distributed(2, _body, case, str(tmp_path))
    first = results[0]
    assert [r["files"] for r in results] == [[FILES[0]], [FILES[1]]]  # rank r wrote file r, and only it
    model = _build(case)[0]
    tied = {"lm_head.weight"} if case != "tp2" else set()
    params = {name for name, _ in model.named_parameters()}
    buffers = {"marker"} if case == "zero0" else set()
    assert tied.isdisjoint(params) and tied <= set(model.state_dict())  # tied: written once, under the wte name
    weight_map = _check_layout(tmp_path / "default", params | buffers, FILES)
    assert weight_map == _check_layout(tmp_path / "report", params | buffers, FILES)
    if buffers:
        assert weight_map["marker"] == FILES[0]

    # Rank 0 never held a whole copy: the tensors it made for the save peaked at a few parameters, and it
    # received well under the model.
    assert first["peak"] < first["total"], (first["peak"], first["total"])
    assert first["peak"] <= 4 * first["largest"], (first["peak"], first["largest"])
    assert first["received"] < first["total"] / 2
    print(
        f"{case}: rank-0 peak held {first['peak']} B, largest parameter {first['largest']} B, model {first['total']} B, "
        f"rank 0 received {first['received']} B"
    )

    loaded = _load(tmp_path / "default", _build(case)[0])
    saved = loaded.state_dict()
    for name in params:  # the engine's fp32 masters, rounded to the training dtype
        assert torch.equal(saved[name], first["state"][name].to(first["dtype"]).float()), name
    if tied:
        assert loaded.lm_head.weight.data_ptr() == loaded.get_input_embeddings().weight.data_ptr()  # re-tied
    with torch.no_grad():
        logits = loaded(input_ids=first["tokens"]).logits
    tolerance = {"atol": 3e-2, "rtol": 3e-2} if first["dtype"] == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(logits, first["logits"], **tolerance)
    if first["dtype"] == torch.bfloat16:  # exact against a plain model holding the same rounded weights
        plain = _build(case)[0]
        plain.load_state_dict({k: v.bfloat16().float() for k, v in first["state"].items()}, strict=False)
        plain.tie_weights()
        with torch.no_grad():
            torch.testing.assert_close(logits, plain.eval()(input_ids=first["tokens"]).logits, atol=1e-5, rtol=1e-5)

    if case == "zero0":
        assert sorted(p.name for p in (tmp_path / "single").iterdir()) == ["model.safetensors"]
        for r in results:
            assert "rank 1: [Errno 28] No space left on device" in r["extra"]["full_disk"], r["extra"]["full_disk"]
        assert not (tmp_path / "full" / INDEX).exists()
    if case == "zero2-bf16":
        from safetensors.torch import load_file

        assert [r["extra"]["fp32"] for r in results] == [[FILES[0]], [FILES[1]]]
        fp32 = {k: v for name in FILES for k, v in load_file(tmp_path / "fp32" / name).items()}
        assert all(torch.equal(fp32[k], first["state"][k]) for k in params)  # fp32 on request: the masters exactly
    if case == "zero3":
        small = [r["extra"]["small"] for r in results]
        names = small[0] + small[1]
        assert len(small[0]) >= 2 and len(small[1]) >= 2 and len(set(names)) == len(names)
        assert names == [f"model-{i:05d}-of-{len(names):05d}.safetensors" for i in range(1, len(names) + 1)]
        _check_layout(tmp_path / "small", params, names)
        torch.testing.assert_close(_load(tmp_path / "small", _build(case)[0])(input_ids=first["tokens"]).logits, logits)
        assert set(first["extra"]["frozen"]) == params - {"transformer.wpe.weight"}
