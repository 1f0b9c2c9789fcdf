"""Hosts under model-parallel meshes (issue 27, cases 6, 7, 11): data is sharded by the dp coordinate, never by world size.

With Ulysses (``sequence_parallel_size: 2``) or zig-zag context parallelism (``context_parallel.size: 2``)
on 2 ranks, dp = 1: both ranks must read every micro-batch, the ``"auto"`` batch sizes count dp,
and the loss trained and logged by the Hugging Face Trainer and by an Accelerate loop is the
one a single process computes on the same global batches.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_distributed
from tests.reference import train_lm_reference

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

SEQ, VOCAB, MB, GAS, STEPS, LR = 16, 128, 2, 2, 2, 1e-3  # SEQ: a multiple of 2 × cp for zig-zag chunks
MESHES: dict[str, dict[str, Any]] = {
    "ulysses": {"sequence_parallel_size": 2},
    "zigzag": {"context_parallel": {"size": 2, "method": "zigzag"}},
}
# Issue 30 item 11: the Trainer under tensor and pipeline parallelism, with the config's optimizer or its own.
CUT_MESHES: dict[str, dict[str, Any]] = {
    "tp": {"tensor_parallel": {"autotp_size": 2}},
    "tp-zero3": {"tensor_parallel": {"autotp_size": 2}, "zero_optimization": {"stage": 3}},
}


def _llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        bos_token_id=0,
        eos_token_id=0,
        attention_dropout=0.0,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def _rows(n: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(7))


def _config(mesh: str) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 1},
        **{**MESHES, **CUT_MESHES}[mesh],
    }


def _reference(windows: list[torch.Tensor]) -> list[float]:
    """One process, whole sequences, each window's micro-batches as one batch: AdamW, no clipping, constant LR."""
    return train_lm_reference(_llama(), windows, LR, bounds=False)[0]


def _reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _all(value: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


# ---------------------------------------------------------------------- the Hugging Face Trainer
def _trainer_arguments(mesh: str, out: Path, trainer_optimizer: bool = False) -> Any:
    from slipstream.integrations.transformers import SlipstreamTrainingArguments

    config = _config(mesh)
    if not trainer_optimizer:  # else the Trainer builds AdamW over the parameters from before the cut
        config["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        }
    return SlipstreamTrainingArguments(
        output_dir=str(out),
        deepspeed=config,
        per_device_train_batch_size=MB,
        gradient_accumulation_steps=GAS,
        learning_rate=LR,
        max_grad_norm=0.0,
        lr_scheduler_type="constant",
        num_train_epochs=1,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        save_strategy="no",
        dataloader_num_workers=0,
        weight_decay=0.0,
    )


def _trainer_body(mesh: str, trainer_optimizer: bool = False) -> dict[str, Any]:
    from slipstream.integrations.transformers import SlipstreamTrainer

    _reset_accelerate()
    args = _trainer_arguments(mesh, Path(tempfile.mkdtemp(prefix="slipstream-hf-mesh-")) / "run", trainer_optimizer)
    seen: list[torch.Tensor] = []

    def collate(features: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        batch = {k: torch.stack([f[k] for f in features]) for k in features[0]}
        seen.append(batch["input_ids"].clone())
        return batch

    dataset = [{"input_ids": row, "labels": row} for row in _rows(MB * GAS * STEPS)]  # dp 1: every rank reads all rows
    trainer = SlipstreamTrainer(model=_llama(), args=args, train_dataset=dataset, data_collator=collate)
    trainer.train()
    engine = trainer.model_wrapped
    result = {
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "steps": trainer.state.global_step,
        "seen": _all(seen),
        "batch": (
            engine.config.train_batch_size,
            engine.train_micro_batch_size_per_gpu(),
            engine.gradient_accumulation_steps(),
        ),
        "dp": (engine.mesh.size("dp"), engine.mesh.rank_of("dp")),
    }
    trainer.accelerator.free_memory()
    return result


@pytest.mark.parametrize("mesh", sorted(MESHES))
def test_trainer_under_sequence_and_context_parallel_matches_one_process(mesh: str) -> None:
    results = run_distributed(2, _trainer_body, mesh)
    result = results[0]
    assert result["dp"] == (1, 0) and results[1]["dp"] == (1, 0)
    assert result["batch"] == (MB * GAS * 1, MB, GAS)  # train_batch_size = micro × accumulation × dp
    assert result["steps"] == STEPS
    seen = result["seen"]
    assert len(seen[0]) == GAS * STEPS
    for mine, other in zip(seen[0], seen[1], strict=True):  # both ranks of the group read the same micro-batches
        assert torch.equal(mine, other)
    assert sorted(torch.cat(seen[0]).tolist()) == sorted(_rows(MB * GAS * STEPS).tolist())  # each row once (shuffled)
    windows = [torch.cat(seen[0][s * GAS : (s + 1) * GAS]) for s in range(STEPS)]
    ref = _reference(windows)
    for r in results:  # the logged loss is the whole sequence's, on every rank
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref), rtol=1e-5, atol=0)


@pytest.mark.parametrize("trainer_optimizer", [False, True], ids=["config-optimizer", "trainer-optimizer"])
@pytest.mark.parametrize("mesh", sorted(CUT_MESHES))
def test_trainer_under_tensor_and_pipeline_parallel_matches_one_process(mesh: str, trainer_optimizer: bool) -> None:
    """ "auto" batch sizes count dp (1 here), and an optimizer the Trainer built before the cut steps the cut parameters."""
    results = run_distributed(2, _trainer_body, mesh, trainer_optimizer)
    result = results[0]
    assert [r["dp"] for r in results] == [(1, 0), (1, 0)]
    assert result["batch"] == (MB * GAS, MB, GAS) and result["steps"] == STEPS
    seen = result["seen"]
    for mine, other in zip(seen[0], seen[1], strict=True):
        assert torch.equal(mine, other)
    windows = [torch.cat(seen[0][s * GAS : (s + 1) * GAS]) for s in range(STEPS)]
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(_reference(windows)), rtol=1e-5, atol=0)


def _pipeline_trainer_body() -> str:
    from slipstream.integrations.transformers import SlipstreamTrainer, SlipstreamTrainingArguments

    _reset_accelerate()
    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
        "pipeline": {"stages": 2},
    }
    args = SlipstreamTrainingArguments(output_dir=tempfile.mkdtemp(), deepspeed=config, use_cpu=True, report_to="none")
    with pytest.raises(ValueError) as err:
        SlipstreamTrainer(model=_llama(), args=args)
    return str(err.value)


def test_trainer_refuses_a_pipeline_saying_what_to_do() -> None:
    for message in run_distributed(2, _pipeline_trainer_body):
        assert "pipeline.stages=2 is not supported under the Trainer:" in message and "engine.train_batch()" in message


# ---------------------------------------------------------------------- Accelerate
def _accelerate_body(mesh: str) -> dict[str, Any]:
    from slipstream.integrations.accelerate import SlipstreamAccelerator, SlipstreamPlugin

    _reset_accelerate()
    plugin = SlipstreamPlugin(hf_ds_config=_config(mesh), gradient_accumulation_steps=GAS)
    accelerator = SlipstreamAccelerator(slipstream_plugin=plugin, cpu=True)
    model = _llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    torch.manual_seed(1000 + dist.get_rank())  # a different global RNG per rank: the shuffle must not depend on it
    loader = torch.utils.data.DataLoader(list(_rows(MB * GAS * STEPS)), batch_size=MB, shuffle=True)
    engine, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    seen, raw, logged = [], [], []
    total = torch.zeros(())
    for i, tokens in enumerate(loader):
        seen.append(tokens.clone())
        with accelerator.accumulate(engine):
            loss = engine(input_ids=tokens, labels=tokens).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        total += loss.detach()
        if (i + 1) % GAS == 0:
            gathered = accelerator.gather_for_metrics(total.reshape(1))  # one value per dp coordinate
            assert gathered.shape == (1,), gathered.shape
            raw.append(float(total) / GAS)
            logged.append(float(gathered.mean()) / GAS)
            total = torch.zeros(())
    result = {
        "seen": _all(seen),
        "raw": raw,
        "logged": logged,
        "steps": engine.global_steps,
        "batch": (
            engine.config.train_batch_size,
            engine.train_micro_batch_size_per_gpu(),
            engine.gradient_accumulation_steps(),
        ),
    }
    engine.close()
    return result


@pytest.mark.parametrize("mesh", sorted(MESHES))
def test_accelerate_under_sequence_and_context_parallel_matches_one_process(mesh: str) -> None:
    results = run_distributed(2, _accelerate_body, mesh)
    result = results[0]
    assert result["batch"] == (MB * GAS * 1, MB, GAS)  # "auto" filled from the loader: micro × accumulation × dp
    assert result["steps"] == STEPS
    seen = result["seen"]
    assert len(seen[0]) == GAS * STEPS
    for mine, other in zip(seen[0], seen[1], strict=True):
        assert torch.equal(mine, other)
    windows = [torch.cat(seen[0][s * GAS : (s + 1) * GAS]) for s in range(STEPS)]
    ref = _reference(windows)
    for r in results:
        torch.testing.assert_close(torch.tensor(r["raw"]), torch.tensor(ref), rtol=1e-5, atol=0)
        torch.testing.assert_close(torch.tensor(r["logged"]), torch.tensor(ref), rtol=1e-5, atol=0)


# ---------------------------------------------------------------------- "auto" batch sizes, both hosts
def _auto_body() -> dict[str, Any]:
    from slipstream.integrations.accelerate import DummyOptim, SlipstreamAccelerator, SlipstreamPlugin

    _reset_accelerate()
    args = _trainer_arguments("ulysses", Path(tempfile.mkdtemp(prefix="slipstream-hf-auto-")) / "run")
    filled = args.slipstream_config
    trainer_sizes = (
        filled["train_batch_size"],
        filled["train_micro_batch_size_per_gpu"],
        filled["gradient_accumulation_steps"],
    )
    _reset_accelerate()
    config = {**_config("ulysses"), "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}}}
    accelerator = SlipstreamAccelerator(
        slipstream_plugin=SlipstreamPlugin(hf_ds_config=config, gradient_accumulation_steps=GAS), cpu=True
    )
    model = _llama()
    loader = torch.utils.data.DataLoader(list(_rows(8)), batch_size=MB)
    engine, _, loader = accelerator.prepare(model, DummyOptim(model.parameters(), lr=LR, weight_decay=0.0), loader)
    accelerate_sizes = (
        engine.config.train_batch_size,
        engine.train_micro_batch_size_per_gpu(),
        engine.gradient_accumulation_steps(),
    )
    engine.close()
    return {"trainer": trainer_sizes, "accelerate": accelerate_sizes, "loader_batches": len(loader)}


def test_auto_batch_sizes_count_data_parallel_ranks_not_processes() -> None:
    for result in run_distributed(2, _auto_body):
        assert result["trainer"] == (MB * GAS * 1, MB, GAS)  # not world × micro × accumulation = 8
        assert result["accelerate"] == (MB * GAS * 1, MB, GAS)
        assert result["loader_batches"] == 8 // MB  # unsharded: dp = 1


# ---------------------------------------------------------------------- the layout itself (no processes)
def test_data_parallel_layout_follows_the_engine_mesh_order() -> None:
    from slipstream.integrations._mesh import data_parallel_layout

    plain = data_parallel_layout({"zero_optimization": {"stage": 2}}, 4, 3)
    assert (plain.size, plain.rank, plain.shared, plain.readers) == (4, 3, False, (0, 1, 2, 3))
    # world 8 = pp 1 × dp 2 × cp 1 × sp 2 × tp 2: rank = (dp·2 + sp)·2 + tp
    layouts = [
        data_parallel_layout({"sequence_parallel_size": 2, "tensor_parallel": {"autotp_size": 2}}, 8, r)
        for r in range(8)
    ]
    assert [lay.rank for lay in layouts] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert layouts[0].readers == (0, 4) and layouts[0].sharers == 4 and layouts[0].sequence_split
    # pipeline outermost: world 4 = pp 2 × dp 2
    piped = [data_parallel_layout({"pipeline": {"stages": 2}}, 4, r) for r in range(4)]
    assert [lay.rank for lay in piped] == [0, 1, 0, 1] and piped[0].readers == (0, 1) and not piped[0].sequence_split
    cp = data_parallel_layout(
        {"context_parallel": {"size": 2, "method": "zigzag"}, "pipeline": {"stages": "auto"}}, 2, 1
    )
    assert (cp.size, cp.rank, cp.sequence_split) == (1, 0, True)


def test_lightning_distributed_sampler_shards_by_data_parallel_rank() -> None:
    pytest.importorskip("lightning")
    from slipstream.integrations.lightning import SlipstreamStrategy

    class _Environment:  # the two numbers the strategy reads from Lightning's cluster environment
        def __init__(self, rank: int) -> None:
            self.rank = rank

        def world_size(self) -> int:
            return 4

        def global_rank(self) -> int:
            return self.rank

    kwargs = []
    for rank in range(4):
        strategy = SlipstreamStrategy(config={"zero_optimization": {"stage": 2}, "sequence_parallel_size": 2})
        strategy.cluster_environment = _Environment(rank)
        kwargs.append(strategy.distributed_sampler_kwargs)
    assert kwargs == [{"num_replicas": 2, "rank": r} for r in (0, 0, 1, 1)]
    plain = SlipstreamStrategy(stage=2)
    plain.cluster_environment = _Environment(3)
    assert plain.distributed_sampler_kwargs == {"num_replicas": 4, "rank": 3}
