"""Where the first-batch twin check looks ([Note: a window that crosses the model's ranges] in
parallel/sequence/first_batch.py): a boundary with context on both sides, long enough to cross the attention
range the model declares, spanning a length-dependent rotary threshold, and never beyond the estimator's cap."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from slipstream.engine.parallel.sequence import first_batch
from slipstream.engine.parallel.sequence.first_batch import affordable_tokens, first_batch_window, model_ranges


def _config(cls_name: str, **extra: Any) -> Any:
    import transformers

    common = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        pad_token_id=0,
        attn_implementation="sdpa",
    )
    common.update(extra)
    return getattr(transformers, cls_name)(**common)


def _llama(**extra: Any) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(_config("LlamaConfig", **extra))


def _mistral(window: int) -> torch.nn.Module:
    from transformers import MistralForCausalLM

    return MistralForCausalLM(_config("MistralConfig", sliding_window=window))


def _batch(rows: int, length: int, padded_from: int | None = None) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 96, (rows, length))
    batch = {"input_ids": ids, "labels": ids.clone()}
    if padded_from is not None:
        mask = torch.ones(rows, length, dtype=torch.long)
        mask[-1, padded_from:] = 0  # the last row carries the boundary
        batch["attention_mask"] = mask
    return batch


def _span(found: Any) -> tuple[int, int]:
    window, _ = found
    positions = window["position_ids"].flatten()
    return int(positions[0]), int(positions[-1]) + 1


def test_a_model_without_ranges_keeps_the_least_window_centred_on_the_boundary() -> None:
    model = _llama()
    assert model_ranges(model) == (0, [])
    found = first_batch_window(_batch(2, 512, padded_from=400), "sequence_parallel_size", model, divisor=2, size=2)
    assert _span(found) == (368, 432)
    assert "row 1, tokens 368-432 of 512" in found[1]


def test_the_window_crosses_a_sliding_window_longer_than_the_least_one_inside_one_document() -> None:
    model = _mistral(100)
    assert model_ranges(model)[0] == 100
    start, stop = _span(first_batch_window(_batch(4, 512), "sequence_parallel_size", model, divisor=2, size=2))
    assert (start, stop) == (0, 100 + 64 + 32)
    # right padding at 400: the longer run (the 400 valid tokens) fills the window, the padding keeps 32 tokens
    start, stop = _span(
        first_batch_window(_batch(4, 512, padded_from=400), "sequence_parallel_size", model, divisor=2, size=2)
    )
    assert stop == 432 and 400 - start > 100, (start, stop)


def test_a_range_the_row_does_not_exceed_changes_nothing() -> None:
    found = first_batch_window(
        _batch(2, 512, padded_from=400), "sequence_parallel_size", _mistral(4096), divisor=2, size=2
    )
    assert _span(found) == (368, 432)


def _no_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    from slipstream.accelerator import get_accelerator

    monkeypatch.setattr(type(get_accelerator()), "free_memory", lambda self: 0)


def test_the_estimator_caps_the_window_at_one_ranks_share_of_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_free_memory(monkeypatch)
    warned: list[str] = []
    monkeypatch.setattr(first_batch.logger, "warning", lambda msg, *args: warned.append(msg % args))
    model = _mistral(200)
    assert affordable_tokens(model, rows=1, length=256, size=2) == 128  # flash attention: activations linear in tokens
    start, stop = _span(first_batch_window(_batch(1, 256), "sequence_parallel_size", model, divisor=2, size=2))
    assert stop - start == 128
    assert warned and "window (128 tokens) does not cross the model's attention range of 200 tokens" in warned[0], (
        warned
    )


def test_free_memory_lets_the_window_grow_past_one_ranks_share() -> None:
    assert affordable_tokens(_mistral(200), rows=1, length=256, size=2) == 256  # a tiny model: the whole row fits


def test_eager_attention_keeps_its_scores_so_it_affords_fewer_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_free_memory(monkeypatch)
    sdpa, eager = _llama(), _llama(attn_implementation="eager")
    assert affordable_tokens(sdpa, rows=1, length=4096, size=2) == 2048  # linear in tokens: half the row
    assert affordable_tokens(sdpa, rows=4, length=4096, size=2) == 4096  # 4 rows over 2 ranks: the whole row
    assert 0 < affordable_tokens(eager, rows=1, length=4096, size=2) < 2048 / 4


def test_a_length_dependent_rotary_threshold_falls_in_the_windows_last_quarter() -> None:
    model = _llama(max_position_embeddings=128, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert model_ranges(model) == (0, [128])
    start, stop = _span(first_batch_window(_batch(2, 512), "sequence_parallel_size", model, divisor=2, size=2))
    assert stop - start == 64 and start + 32 <= 128 < stop, (start, stop)  # the first shard (half) stays below
    static = _llama(rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert model_ranges(static) == (0, [])


def test_ranges_are_read_from_modules_and_per_layer_lists() -> None:
    class Local(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention_window = [8, 48]  # Longformer's per-layer windows
            self.proj = torch.nn.Linear(4, 4)

    assert model_ranges(Local()) == (48, [])


def test_a_window_the_config_switches_off_is_no_range() -> None:
    from transformers import Qwen2ForCausalLM

    assert model_ranges(Qwen2ForCausalLM(_config("Qwen2Config", sliding_window=100, use_sliding_window=False)))[0] == 0
    assert model_ranges(Qwen2ForCausalLM(_config("Qwen2Config", sliding_window=100, use_sliding_window=True)))[0] == 100


def test_sub_configs_are_read() -> None:
    import transformers

    config = transformers.Gemma3Config(
        text_config=dict(
            vocab_size=96,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            sliding_window=40,
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            image_size=28,
            patch_size=14,
        ),
    )
    model = torch.nn.Linear(2, 2)
    model.config = config  # type: ignore[assignment]
    assert model_ranges(model)[0] == 40
