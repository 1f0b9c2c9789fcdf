"""The pipeline's stage forwards ask transformers models for no key/value cache ([Note: no cache in a pipeline stage])."""

from __future__ import annotations

import torch
import transformers

from slipstream.engine.parallel.calls import accepts_use_cache, call_model, without_cache


def _tiny_gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    return transformers.GPT2LMHeadModel(config).eval()  # no dropout: the two calls compare exactly


def test_a_transformers_model_built_without_cache_returns_none() -> None:
    model = _tiny_gpt2()
    ids = torch.randint(0, 64, (2, 8))
    assert accepts_use_cache(model)
    assert call_model(model, {"input_ids": ids}).past_key_values is not None  # what the stage used to build
    out = call_model(model, without_cache({"input_ids": ids, "labels": ids}))
    assert out.past_key_values is None
    reference = model(input_ids=ids, labels=ids)
    torch.testing.assert_close(out.loss, reference.loss, rtol=0, atol=0)


def test_the_users_choice_and_other_batches_are_left_alone() -> None:
    assert without_cache({"input_ids": 1, "use_cache": True}) == {"input_ids": 1, "use_cache": True}
    assert without_cache((1, 2)) == (1, 2)
    assert not accepts_use_cache(torch.nn.Linear(2, 2))
