"""Correct or refused under a pipeline (issue 27, cases 8-10 and the twin check): what a cut cannot carry is
refused at ``initialize`` in one line, and a cut that misses a block call is caught by the numerical twin check."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import slipstream
from tests.distributed.test_pipeline import _config, _gpt2
from tests.harness import run_distributed
from tests.zoo.models import EncoderLM, LoopedLM, PlainLM, ValueResidualLM

VOCAB, HIDDEN = 64, 16  # the encoder-decoders built here; the custom LMs come from the zoo


MODELS = {"x0": ValueResidualLM, "looped": LoopedLM, "plain": PlainLM, "bart": lambda: _bart()}


def _refusal(name: str) -> str:
    try:
        slipstream.initialize(MODELS[name](), _config(2, "1f1b", 2))
    except slipstream.ConfigError as err:
        return str(err)
    return "accepted"


def test_value_residual_blocks_train() -> None:
    """Case 8: a block reading the embedding output besides its hidden state: the first stage hands it on with the
    hidden state (later stages would get the stand-in's zeros), and the twin check sees the cut match."""
    for message in run_distributed(2, _refusal, "x0"):
        assert message == "accepted", message


def test_looped_blocks_are_refused() -> None:
    """Case 10: a block list run twice per forward (the second pass would be dropped)."""
    for message in run_distributed(2, _refusal, "looped"):
        assert message.startswith("pipeline.stages: LoopedLM: block 'layers.0' runs 2 times per forward"), message


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
        assert "transformer.h.1" in message or "the step's loss" in message, message


def _bart() -> torch.nn.Module:
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    return BartForConditionalGeneration(
        BartConfig(
            vocab_size=VOCAB,
            d_model=HIDDEN,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=32,
            decoder_ffn_dim=32,
            max_position_embeddings=64,
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
            decoder_start_token_id=2,
        )
    )


def test_an_encoder_decoder_is_accepted_by_the_twin_check() -> None:
    """Case 9: embeddings shared by encoder, decoder and head. The pipeline cuts the encoder's block list; the LayerNorm
    after the embeddings hands its input on where stage 0 does not run (it keeps the shape), the decoder and head run
    with the last stage, the embeddings at both ends have their gradients summed; the twin check compares the cut's
    first step with the whole model's (the zoo trains it: tests/zoo, bart × pp-1f1b)."""
    for message in run_distributed(2, _refusal, "bart"):
        assert message == "accepted", message


def _opt() -> torch.nn.Module:
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    return OPTForCausalLM(
        OPTConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            num_hidden_layers=4,
            ffn_dim=32,
            num_attention_heads=2,
            max_position_embeddings=64,
            word_embed_proj_dim=HIDDEN,
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
            pad_token_id=1,
        )
    )


def _t5() -> torch.nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    return T5ForConditionalGeneration(
        T5Config(
            vocab_size=VOCAB,
            d_model=HIDDEN,
            d_kv=8,
            d_ff=32,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=2,
            dropout_rate=0.0,
            decoder_start_token_id=0,
            pad_token_id=0,
        )
    )


class FirstWeightLM(PlainLM):
    """Custom: the forward reads the first block's weight (its dtype), which only the first stage holds."""

    def hidden(self, x0: torch.Tensor) -> torch.Tensor:
        return super().hidden(x0.to(self.layers[0].linear.weight.dtype))


MODELS.update({"opt": _opt, "t5": _t5, "encoder": EncoderLM, "first-weight": FirstWeightLM})


@pytest.mark.parametrize("name", ["opt", "encoder"])
def test_models_that_read_the_blocks_settings_train(name: str) -> None:
    """Case 14: prologue and epilogue by execution order (OPT registers final_layer_norm before its layers);
    nn.TransformerEncoder reads ``layers[0].self_attn.batch_first``, which the stand-ins keep as a shell."""
    for message in run_distributed(2, _refusal, name):
        assert message == "accepted", message


@pytest.mark.parametrize(
    "name,expected",
    [
        ("t5", "block 'encoder.block.1' reads an activation besides its hidden state"),
        ("first-weight", "stage 1 fails on its own (AttributeError: '_Shell' object has no attribute 'weight')"),
    ],
)
def test_models_a_cut_breaks_are_refused_on_every_rank(name: str, expected: str) -> None:
    """Case 15: T5 and a model reading another stage's weight are refused at initialize on every rank (no crash, no
    rank left waiting)."""
    for message in run_distributed(2, _refusal, name, timeout=120):
        assert message.startswith("pipeline.stages:") and expected in message and "\n" not in message, message


def _config_error(layers: int, extra: dict[str, Any]) -> str:
    from tests.distributed.test_pipeline import _llama

    config = _config(2, "1f1b", 4)
    config["pipeline"].update(extra)
    if extra.get("schedule") == "interleaved_1f1b":
        config["gradient_accumulation_steps"] = 4
    try:
        slipstream.initialize(_llama(layers), config)
    except slipstream.ConfigError as err:
        return str(err)
    return "accepted"


@pytest.mark.parametrize(
    "layers,extra,expected",
    [
        (1, {}, "pipeline.stages: 2 stages need at least 2 blocks; LlamaForCausalLM has 1 (model.layers)"),
        (
            2,
            {"schedule": "interleaved_1f1b", "virtual_stages": 2},
            "pipeline.virtual_stages: 2 ranks × 2 virtual stages = 4 stages need at least 4 blocks",
        ),
        (4, {"partition": "type:(["}, "pipeline.partition: 'type:([': '([' is not a regular expression"),
    ],
)
def test_pipeline_errors_name_the_right_key(layers: int, extra: dict[str, Any], expected: str) -> None:
    """Case 18: every rank refuses together, naming the key that is wrong."""
    for message in run_distributed(2, _config_error, layers, extra, timeout=120):
        assert message.startswith(expected) and "\n" not in message, message


def _epoch_body(pp: int) -> dict[str, Any]:
    """Case 16: DeepSpeed's epoch idiom around train_batch, with an iterator that ends inside the window."""
    from tests.distributed.test_pipeline import _batches

    config = _config(pp, "1f1b", 2) if pp > 1 else {**_config(1, "1f1b", 2), "pipeline": {}}
    tokens = _batches(8, steps=1)[0]
    micro = [{"input_ids": t, "labels": t} for t in tokens.split(2)][:3]  # 3 micro-batches for windows of 2
    results = {}
    for name, sequence in (("interrupted", [micro[:3], micro[:2]]), ("clean", [micro[:2], micro[:2]])):
        engine = slipstream.initialize(_gpt2(), config)
        it, losses, stops = iter(sequence[0]), [], []
        for _ in range(3):
            try:
                losses.append(float(engine.train_batch(it)))
            except StopIteration as stop:
                stops.append(str(stop))
                it = iter(sequence[1])
        results[name] = {"losses": losses, "stops": stops, "steps": engine.global_steps}
        engine.close()
    return results


@pytest.mark.parametrize("pp", [1, 2])
def test_train_batch_epoch_idiom_drops_a_partial_window(pp: int) -> None:
    for result in run_distributed(2, _epoch_body, pp):
        interrupted, clean = result["interrupted"], result["clean"]
        assert (
            len(interrupted["stops"]) == 1
            and "ended after 1 of the window's 2 micro-batches" in interrupted["stops"][0]
        )
        assert interrupted["steps"] == 2 and interrupted["losses"] == pytest.approx(clean["losses"][:2], rel=1e-6)


def _grouped(model: torch.nn.Module) -> list[dict[str, Any]]:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def _groups_body(mode: str) -> list[float]:
    """Case 17: decay / no-decay groups built before initialize, under tp or pp (their parameters get replaced)."""
    from tests.distributed.test_pipeline import _batches, _llama

    model = _llama()
    config = (
        _config(2, "1f1b", 2)
        if mode == "pp"
        else {**_config(1, "1f1b", 2), "pipeline": {}, "tensor_parallel": {"autotp_size": 2}}
    )
    engine = slipstream.initialize(model, config, model_parameters=_grouped(model))
    losses = []
    for tokens in _batches(8, steps=2):
        micro = [{"input_ids": t, "labels": t} for t in tokens.split(4)]
        losses.append(float(engine.train_batch(iter(micro))))
    engine.close()
    return losses


@pytest.mark.parametrize("mode", ["tp", "pp"])
def test_parameter_groups_built_before_initialize_follow_the_parallel_parameters(mode: str) -> None:
    from tests.distributed.test_pipeline import LR, _batches, _llama

    model = _llama()
    optimizer = torch.optim.AdamW(_grouped(model), lr=LR)
    expected = []
    for tokens in _batches(8, steps=2):
        losses = []
        for t in tokens.split(4):
            loss = model(input_ids=t, labels=t).loss
            (loss / 2).backward()
            losses.append(float(loss))
        optimizer.step()
        optimizer.zero_grad()
        expected.append(sum(losses) / 2)
    for losses in run_distributed(2, _groups_body, mode):
        assert losses == pytest.approx(expected, rel=1e-5)
