"""Correct or refused under a pipeline (issue 27, cases 8-10 and the twin check): what a cut cannot carry is
refused at ``initialize`` in one line, and a cut that misses a block call is caught by the numerical twin check."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import slipstream
from tests.distributed.test_pipeline import _config, _gpt2
from tests.harness import run_distributed

VOCAB, HIDDEN = 64, 16


class _Output:
    def __init__(self, loss: torch.Tensor) -> None:
        self.loss = loss


class _Block(torch.nn.Module):
    def __init__(self, reads_x0: bool) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(HIDDEN, HIDDEN)
        self.reads_x0 = reads_x0

    def forward(self, x: torch.Tensor, x0: torch.Tensor | None = None) -> torch.Tensor:
        x = x + torch.tanh(self.linear(x))
        return x + 0.5 * x0 if self.reads_x0 else x


class _CustomLM(torch.nn.Module):
    """A small LM written by hand: value-residual blocks (``block(x, x0)``) or a block list run twice (looped depth)."""

    def __init__(self, reads_x0: bool = False, loops: int = 1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.layers = torch.nn.ModuleList([_Block(reads_x0) for _ in range(4)])
        self.head = torch.nn.Linear(HIDDEN, VOCAB)
        self.reads_x0, self.loops = reads_x0, loops

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> _Output:
        x0 = self.embed(input_ids)
        x = x0
        for _ in range(self.loops):
            for layer in self.layers:
                x = layer(x, x0) if self.reads_x0 else layer(x)
        logits = self.head(x)
        return _Output(F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1)))


MODELS = {
    "x0": lambda: _CustomLM(reads_x0=True), "looped": lambda: _CustomLM(loops=2), "plain": lambda: _CustomLM(),
    "bart": lambda: _bart(),
}  # fmt: skip


def _refusal(name: str) -> str:
    try:
        slipstream.initialize(MODELS[name](), _config(2, "1f1b", 2))
    except slipstream.ConfigError as err:
        return str(err)
    return "accepted"


def test_value_residual_blocks_are_refused() -> None:
    """Case 8: a block reading the embedding output besides its hidden state (later stages would get zeros)."""
    for message in run_distributed(2, _refusal, "x0"):
        assert message.startswith("pipeline.stages: _CustomLM: block 'layers.0' reads an activation besides its hidden state"), message


def test_looped_blocks_are_refused() -> None:
    """Case 10: a block list run twice per forward (the second pass would be dropped)."""
    for message in run_distributed(2, _refusal, "looped"):
        assert message.startswith("pipeline.stages: _CustomLM: block 'layers.0' runs 2 times per forward"), message


def test_a_plain_custom_lm_trains_under_the_twin_check() -> None:
    for message in run_distributed(2, _refusal, "plain"):
        assert message == "accepted", message


def _skipping_cut_body() -> str:
    """A fault in the cut (the gate passes block 1 through instead of running it): no rule names it, the twin check sees it."""
    from slipstream.engine.parallel.pipeline import cut

    original = cut.StageGate._gated

    def skipping(self: Any, index: int, forward: Any) -> Any:
        gated = original(self, index, forward)
        return (lambda *args, **kwargs: cut._hidden_of(args, kwargs)) if index == 1 else gated

    cut.StageGate._gated = skipping
    try:
        slipstream.initialize(_gpt2(), _config(2, "1f1b", 2))
    except slipstream.ConfigError as err:
        return str(err)
    finally:
        cut.StageGate._gated = original
    return "accepted"


def test_twin_check_refuses_a_cut_that_skips_a_block() -> None:
    for message in run_distributed(2, _skipping_cut_body):
        assert "twin check" in message and "\n" not in message, message
        assert "transformer.h.1" in message or "the loss of micro-batch 0" in message, message


def _bart() -> torch.nn.Module:
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    return BartForConditionalGeneration(BartConfig(
        vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
    ))  # fmt: skip


@pytest.mark.parametrize("name", ["bart"])
def test_encoder_decoder_is_refused(name: str) -> None:
    """Case 9: embeddings shared by encoder, decoder and head; the pipeline cuts one block list only."""
    for message in run_distributed(2, _refusal, name):
        assert message.startswith("pipeline.stages:") and "\n" not in message, message
