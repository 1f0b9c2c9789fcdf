"""Blockwise sequence parallel (sequence/blockwise.py): a model no attention kernel reaches trains like one process
under Ulysses and context parallel, its blocks on sequence shards, its position-mixing modules whole."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import slipstream
from slipstream.engine.parallel.anatomy import find_blocks
from slipstream.engine.parallel.sequence.blockwise import position_mixers
from tests.harness import run_distributed
from tests.noise import assert_weights_close
from tests.reference import train_lm_engine, train_lm_reference
from tests.zoo.models import SEQ, VOCAB, ZOO

LR, ROWS, STEPS = 1e-3, 2, 3


def _t5_heads_as_shard() -> torch.nn.Module:
    """T5 with 8 heads at 16 tokens over 2 ranks: its [b, heads, s, s] relative bias has as many heads as a rank has
    tokens, which a mixer must not take for a shard to gather (it reaches the blocks whole, and stays so)."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    return T5ForConditionalGeneration(
        T5Config(
            vocab_size=VOCAB,
            d_model=32,
            d_kv=4,
            d_ff=64,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=8,
            dropout_rate=0.0,
            decoder_start_token_id=0,
            pad_token_id=0,
        )
    )


BUILDERS = {**ZOO, "t5-8-heads": _t5_heads_as_shard}


def _batches(length: int = SEQ + 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [
        torch.randint(1, VOCAB, (ROWS, length), generator=g) for _ in range(STEPS)
    ]  # 19 tokens: not a multiple of 2


@pytest.mark.parametrize(
    "arch,expected",
    [
        ("torch-encoder", ["self_attn"]),  # nn.MultiheadAttention, found by what it computes
        ("value-residual", []),  # position-wise blocks
        ("bloom-alibi", ["self_attention"]),  # ALiBi added inline, no attention interface
    ],
)
def test_the_modules_that_mix_positions_are_found(arch: str, expected: list[str]) -> None:
    model = ZOO[arch]().eval()
    blocks = find_blocks(model)
    assert blocks is not None
    tokens = _batches()[0]
    mixers, calls = position_mixers(model, blocks, {"input_ids": tokens, "labels": tokens})
    assert mixers == expected
    assert calls == list(range(len(blocks)))


def _config(mode: str, checkpointing: bool) -> dict[str, Any]:
    modes = {"ulysses": {"sequence_parallel_size": 2}, "ring": {"context_parallel": {"size": 2, "method": "ring"}}}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": ROWS,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        **modes[mode],
    }
    if checkpointing:
        config["activation_checkpointing"] = {"module_classes": ["TransformerEncoderLayer"]}
    return config


def _train(arch: str, mode: str, checkpointing: bool, length: int) -> dict[str, Any]:
    from slipstream.engine.parallel.sequence.blockwise import BlockwiseSharder

    engine = slipstream.initialize(BUILDERS[arch](), _config(mode, checkpointing))
    try:
        assert isinstance(engine.parallel.sequence, BlockwiseSharder)
        losses = train_lm_engine(engine, _batches(length), ROWS, 0)
        return {"losses": losses, "weights": {n: p.detach().clone() for n, p in engine.module.named_parameters()}}
    finally:
        engine.close()


@pytest.mark.parametrize(
    "arch,mode,checkpointing,length",
    [
        (
            "value-residual",
            "ulysses",
            False,
            SEQ + 3,
        ),  # its own loss from labels, every block reads the embedding output
        ("torch-encoder", "ring", True, SEQ + 3),  # attention whole inside the shards, recomputed in backward
        ("t5-8-heads", "ulysses", False, 16),  # an encoder-decoder whose bias has as many heads as a shard has tokens
    ],
)
def test_a_model_no_kernel_reaches_trains_like_one_process(
    arch: str, mode: str, checkpointing: bool, length: int
) -> None:
    losses, weights = train_lm_reference(BUILDERS[arch](), _batches(length), LR)
    for result in run_distributed(2, _train, arch, mode, checkpointing, length):
        assert result["losses"] == pytest.approx(losses, rel=1e-5)
        assert_weights_close(result["weights"], weights, label=f"{arch} {mode}")
