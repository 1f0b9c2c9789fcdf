"""The long-context tilings in one process: tiled logits + loss and tiled MLPs against the untiled model.

Every comparison is the same model (a deep copy) run untiled and tiled on the same batch: the loss
within 1e-5 relative and each gradient within 1e-4 of its tensor's largest (measured on this
machine: at most 9e-8 and 7e-7 — the tiles only change the summation order), which a dropped tile,
a wrong shift or a twice-counted gradient (1e-3 and more) cannot meet.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

from slipstream.engine.config import ConfigError, MeshSizes, SlipstreamConfig
from slipstream.engine.parallel.tiling import TilingOptions
from slipstream.engine.parallel.tiling.logits import DeferredLogits, TiledLogits
from slipstream.engine.parallel.tiling.mlp import candidates, tile_mlps, token_wise

VOCAB = 211  # not a multiple of any tile


def _llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            num_hidden_layers=2,
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=VOCAB,
            max_position_embeddings=64,
        )
    )


def _gemma2() -> torch.nn.Module:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    return Gemma2ForCausalLM(
        Gemma2Config(
            num_hidden_layers=2,
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            vocab_size=VOCAB,
            max_position_embeddings=64,
            final_logit_softcapping=2.0,
        )
    )


def _gpt2(dropout: float = 0.0) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(
        GPT2Config(
            n_layer=2,
            n_embd=32,
            n_head=4,
            vocab_size=VOCAB,
            n_positions=64,
            resid_pdrop=dropout,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
    )


class _CustomLM(torch.nn.Module):
    """Not a transformers model: transformers' causal-LM loss as an attribute, and a choice of what happens to the logits."""

    def __init__(self, after_head: str) -> None:
        from transformers.loss.loss_utils import ForCausalLMLoss

        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.body = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, VOCAB, bias=True)
        self.scale = torch.nn.Parameter(torch.tensor(1.5))
        self.after_head = after_head
        self.loss_function = ForCausalLMLoss

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.head

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        logits = self.head(torch.tanh(self.body(self.embed(input_ids))))
        if self.after_head == "slice":
            logits = logits[..., :VOCAB]  # a view: not replayable per tile
        elif self.after_head == "learned-scale":
            logits = logits * self.scale  # a learnable operand: its gradient would not come back from the tiles
        elif self.after_head == "constants":
            logits = -(2.0 - logits / 3.0).float()
        loss = None if labels is None else self.loss_function(logits, labels, VOCAB)
        return {"loss": loss, "logits": logits}


def _loss(out: Any) -> torch.Tensor:
    return out["loss"] if isinstance(out, dict) else out.loss


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(plain: torch.nn.Module, tiled: torch.nn.Module, loss_a: torch.Tensor, loss_b: torch.Tensor) -> None:
    a_value, b_value = float(loss_a.detach()), float(loss_b.detach())
    assert abs(a_value - b_value) <= 1e-5 * abs(a_value), (a_value, b_value)
    a, b = _grads(plain), _grads(tiled)
    assert a.keys() == b.keys()
    for name in a:
        scale = float(a[name].abs().max())
        assert float((a[name] - b[name]).abs().max()) <= 1e-4 * scale + 1e-12, name


def _pair(build: Callable[[], torch.nn.Module], tile: int = 9) -> tuple[torch.nn.Module, torch.nn.Module, TiledLogits]:
    plain = build()
    tiled = copy.deepcopy(plain)
    return plain, tiled, TiledLogits(tiled, tiled.get_output_embeddings(), tile)


def _batch(rows: int = 3, length: int = 21) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(2))
    labels = ids.clone()
    labels[0, :6] = -100
    labels[-1, -4:] = -100
    return ids, labels


@pytest.mark.parametrize("build", [_llama, _gemma2, _gpt2], ids=["llama", "gemma2-softcap", "gpt2-tied"])
@pytest.mark.parametrize("loss_kwargs", ["mean", "num_items_in_batch", "shift_labels"])
def test_tiled_loss_equals_the_models_own(build: Callable[[], torch.nn.Module], loss_kwargs: str) -> None:
    plain, tiled, part = _pair(build)
    ids, labels = _batch()
    kwargs: dict[str, Any] = {"labels": labels}
    if loss_kwargs == "num_items_in_batch":
        kwargs["num_items_in_batch"] = torch.tensor(97)  # the caller's count over a larger window
    elif loss_kwargs == "shift_labels":  # as the engine passes them under sequence parallelism (already shifted)
        kwargs = {
            "labels": labels,
            "shift_labels": torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].contiguous(),
        }
    a = plain(input_ids=ids, **kwargs).loss
    a.backward()
    out = tiled(input_ids=ids, **kwargs)
    assert isinstance(out.__dict__["logits"], DeferredLogits)
    out.loss.backward()
    _assert_same(plain, tiled, a, out.loss)
    part.close()
    assert "forward" not in tiled.get_output_embeddings().__dict__ and "_loss_function" not in tiled.__dict__


def test_reading_the_logits_computes_them_once_with_their_gradient() -> None:
    """A loss term on ``out.logits`` (a z-loss) gets the real logits and their gradient."""
    plain, tiled, _ = _pair(_gemma2)
    ids, labels = _batch()

    def z_loss(out: Any) -> torch.Tensor:
        return out.loss + 1e-2 * out.logits.float().logsumexp(-1).pow(2).mean()

    a = z_loss(plain(input_ids=ids, labels=labels))
    a.backward()
    b = z_loss(tiled(input_ids=ids, labels=labels))
    b.backward()
    _assert_same(plain, tiled, a, b)


@pytest.mark.parametrize("after_head", ["constants", "slice", "learned-scale"])
def test_a_custom_model_is_tiled_or_computed_whole_never_wrong(
    after_head: str, capsys: pytest.CaptureFixture[str]
) -> None:
    plain, tiled, _ = _pair(lambda: _CustomLM(after_head))
    ids, labels = _batch()
    a = _loss(plain(ids, labels))
    a.backward()
    capsys.readouterr()
    b = _loss(tiled(ids, labels))  # labels by position: found by the forward's signature
    b.backward()
    _assert_same(plain, tiled, a, b)
    err = capsys.readouterr().err
    assert ("computed whole" in err) == (after_head != "constants"), (
        err
    )  # replayable ops stay tiled; the others are named


def test_no_labels_or_no_grad_leaves_the_head_alone() -> None:
    _, tiled, _ = _pair(_llama)
    ids, labels = _batch()
    assert type(tiled(input_ids=ids).logits) is torch.Tensor
    with torch.no_grad():
        assert type(tiled(input_ids=ids, labels=labels).logits) is torch.Tensor


def _sizes(pp: int = 1) -> MeshSizes:
    return MeshSizes(pp=pp, dp=1, cp=1, sp=1, tp=1, ep=1)


def test_refusals_name_the_key_and_the_reason() -> None:
    from transformers import BertConfig, BertForMaskedLM

    on = {"train_batch_size": 1, "long_context": {"tiled_logits": {"enabled": True}}}
    cfg = SlipstreamConfig.load(on)
    with pytest.raises(ConfigError, match=r"long_context.tiled_logits: Sequential has no output embeddings"):
        TilingOptions.from_config(cfg, _sizes(), torch.nn.Sequential(torch.nn.Linear(2, 2)), False)
    bert = BertForMaskedLM(
        BertConfig(num_hidden_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=2, vocab_size=50)
    )
    with pytest.raises(
        ConfigError, match=r"BertForMaskedLM's loss is ForMaskedLMLoss, not transformers' ForCausalLMLoss"
    ):
        TilingOptions.from_config(cfg, _sizes(), bert, False)
    assert TilingOptions.from_config(cfg, _sizes(pp=2), _llama(), False) is not None  # the last stage tiles its loss
    stage3 = SlipstreamConfig.load({**on, "zero_optimization": {"stage": 3, "stage3_unit_modules": ["Linear"]}})
    with pytest.raises(ConfigError, match=r"the head Linear is a ZeRO-3 unit"):
        TilingOptions.from_config(stage3, _sizes(), _llama(), False)
    mlp = SlipstreamConfig.load({"train_batch_size": 1, "long_context": {"tiled_mlp": {"enabled": True}}})
    with pytest.raises(ConfigError, match=r"built under zero.Init.*module_classes"):
        TilingOptions.from_config(mlp, _sizes(), _llama(), True)
    assert TilingOptions.from_config(SlipstreamConfig.load({"train_batch_size": 1}), _sizes(), _llama(), False) is None


# --------------------------------------------------------------------------- tiled MLP
def test_the_mlps_are_found_and_the_attention_is_not() -> None:
    gpt2 = _gpt2()
    # GPT-2's attention takes one required argument and holds two Conv1D leaves: only the probe tells it apart
    assert [n for n, _ in candidates(gpt2, None)] == [
        "transformer.h.0.attn",
        "transformer.h.0.mlp",
        "transformer.h.1.attn",
        "transformer.h.1.mlp",
    ]
    assert tile_mlps(gpt2, None, 5, probe=True).names == ["transformer.h.0.mlp", "transformer.h.1.mlp"]
    assert not token_wise(gpt2.transformer.h[0].attn, 32)
    with pytest.raises(
        ConfigError, match=r"module_classes: GPT2Attention \(transformer.h.0.attn\) does not compute each token"
    ):
        tile_mlps(_gpt2(), ["GPT2Attention"], 5, probe=True)
    from tests.reference import tiny_mixtral

    # experts are never tiled (routing depends on the batch): the refusal names the experts' class
    with pytest.raises(ConfigError, match=r"long_context\.tiled_mlp: .*mixtures of experts \(MixtralSparseMoeBlock\)"):
        tile_mlps(tiny_mixtral(), None, 5, probe=True)
    with pytest.raises(ConfigError, match=r"found no MLP to tile"):  # nothing MLP-shaped, and no experts either
        tile_mlps(torch.nn.Sequential(torch.nn.Linear(4, 4)), None, 5, probe=True)


@pytest.mark.parametrize("build", [_llama, _gpt2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("rows", [1, 4])
def test_tiled_mlp_equals_the_untiled_model(build: Callable[[], torch.nn.Module], rows: int) -> None:
    plain = build()
    tiled = copy.deepcopy(plain)
    part = tile_mlps(tiled, None, 7, probe=True)
    ids, labels = _batch(rows)
    a = plain(input_ids=ids, labels=labels).loss
    a.backward()
    b = tiled(input_ids=ids, labels=labels).loss
    b.backward()
    _assert_same(plain, tiled, a, b)
    part.close()
    assert all("forward" not in m.__dict__ for m in tiled.modules())


def test_tiled_mlp_recomputes_with_the_forwards_dropout_masks() -> None:
    """The backward's recomputation draws the forward's masks: the gradient equals a plain loop over the same tiles."""
    from slipstream.engine.parallel.tiling.tiles import tiled as run_tiled

    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Dropout(0.5), torch.nn.Linear(16, 8))
    x = torch.randn(23, 8, requires_grad=True)
    params = list(mlp.parameters())
    names = [n for n, _ in mlp.named_parameters()]
    from slipstream.engine.parallel.tiling.tiles import call_with

    torch.manual_seed(7)
    out = run_tiled(lambda s, piece, w: call_with(mlp, mlp.forward, names, w, piece), x, params, 5, "cat")
    (out * torch.arange(8.0)).sum().backward()
    tiled_grads = [x.grad.clone()] + [p.grad.clone() for p in params]
    x.grad = None
    mlp.zero_grad()
    torch.manual_seed(7)
    looped = torch.cat([mlp(x[s : s + 5]) for s in range(0, 23, 5)])
    assert torch.equal(looped.detach(), out.detach())
    (looped * torch.arange(8.0)).sum().backward()
    for got, want in zip(tiled_grads, [x.grad] + [p.grad for p in params]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_tiles_inside_checkpointed_blocks_equal_the_untiled_model() -> None:
    """Activation checkpointing recomputes each block, tiled MLP inside, and the tiled loss after it: still exact."""
    from slipstream.checkpointing import apply_activation_checkpointing

    plain = _llama()
    tiled = copy.deepcopy(plain)
    apply_activation_checkpointing(tiled, ["LlamaDecoderLayer"])
    tile_mlps(tiled, None, 6, probe=True)
    TiledLogits(tiled, tiled.get_output_embeddings(), 11)
    ids, labels = _batch(rows=2)
    a = plain(input_ids=ids, labels=labels).loss
    a.backward()
    b = tiled(input_ids=ids, labels=labels).loss
    b.backward()
    _assert_same(plain, tiled, a, b)


@pytest.mark.parametrize("reduce", ["sum", "cat"])
def test_tile_gradients_summed_in_their_own_tensors(reduce: str) -> None:
    """The first tile's gradient becomes the sum ([Note: the first tile's gradient]) only where nothing else holds it:
    two parameters added together get one gradient tensor, and an addition passes the incoming gradient through."""
    from slipstream.engine.parallel.tiling.tiles import tiled

    torch.manual_seed(0)
    x = torch.randn(10, 4, requires_grad=True)
    params = [
        torch.randn(4, 4, requires_grad=True),
        torch.randn(4, 4, requires_grad=True),
        torch.randn(4, requires_grad=True),
    ]

    def fn(start: int, piece: torch.Tensor, ps: Any) -> torch.Tensor:
        a, c, bias = ps
        out = piece + bias + (piece @ (a + c)).tanh()
        return out.pow(2).sum() if reduce == "sum" else out

    def run(tile: int) -> list[torch.Tensor]:
        for p in (x, *params):
            p.grad = None
        out = tiled(fn, x, params, tile, reduce) if tile else fn(0, x, params)
        (out if reduce == "sum" else out.pow(2).sum()).backward()
        return [p.grad.clone() for p in (x, *params)]

    for got, want in zip(run(3), run(0)):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
