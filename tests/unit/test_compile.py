"""``compile`` on one process: eager islands, the counters, the config, ``engine.compile`` and a pre-compiled model."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

import slipstream
from slipstream.utils import eager_island
from slipstream.utils.eager_island import declare, island

VOCAB, SEQ = 96, 12
_SCALE = torch.nn.Parameter(torch.linspace(0.5, 1.5, 8))


class _Scaled(torch.autograd.Function):
    """An engine-style function: Python state, a parameter used inside, a custom backward."""

    calls = 0

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: float, tag: str) -> torch.Tensor:
        _Scaled.calls += 1
        ctx.factor = factor
        return x * factor

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return grad * ctx.factor, None, None


def _with_parameter(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return (x * _SCALE)[rows]


declare(_Scaled, lambda x, *_: torch.empty_like(x))
declare(_with_parameter, lambda x, rows: x.new_empty((rows.shape[0], x.shape[1])))


def _block(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(x) * 2
    h = island(_Scaled, (h,), (3.0, "scaled"))
    return island(_with_parameter, (h, rows)).sin().sum()


def _grads(fn: Any, x: torch.Tensor, rows: torch.Tensor) -> tuple[float, torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_(True)
    _SCALE.grad = None
    loss = fn(x, rows)
    loss.backward()
    return float(loss), x.grad, _SCALE.grad.clone()


def _assert_within_float_noise(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to a few float32 roundings of the tensor's scale: inductor's vectorised ``tanh``/``sin`` and their
    fused products round differently from eager's by an ulp or two per element (measured up to 4.8e-7 on a value of
    0.35, beyond a fixed ``atol=1e-7``), while a dropped or mis-scaled gradient is off by O(1) of that scale."""
    torch.testing.assert_close(got, want, rtol=0, atol=16 * torch.finfo(torch.float32).eps * float(want.abs().max()))


def test_island_is_one_graph_and_matches_eager() -> None:
    x, rows = torch.randn(5, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([4, 0, 2])
    eager = _grads(_block, x, rows)
    torch._dynamo.reset()
    compiled = torch.compile(_block, fullgraph=True, backend="inductor")  # a break would raise
    before = _Scaled.calls
    got = _grads(compiled, x, rows)
    assert _Scaled.calls == before + 1, "the island did not run the function eagerly once"
    # the loss sums 24 sines (each within [-1, 1]): a few roundings each, whatever the sum's own size
    assert got[0] == pytest.approx(eager[0], rel=0, abs=24 * 16 * torch.finfo(torch.float32).eps)
    _assert_within_float_noise(got[1], eager[1])
    _assert_within_float_noise(got[2], eager[2])  # the parameter inside got its gradient
    gc.collect()
    assert not eager_island._KEPT, "a kept graph outlived its backward"


def test_island_kept_graphs_are_freed_under_checkpointing_and_without_grad() -> None:
    x, rows = torch.randn(5, 8, requires_grad=True), torch.tensor([1, 3])
    compiled = torch.compile(_block, fullgraph=True, backend="aot_eager")
    loss = torch.utils.checkpoint.checkpoint(compiled, x, rows, use_reentrant=False)
    loss.backward()  # the recomputation's entry is used; the first forward's was dropped with its handle
    del loss
    gc.collect()
    assert not eager_island._KEPT, f"{len(eager_island._KEPT)} kept graph(s) leaked"
    with torch.no_grad():
        compiled(x, rows)
    gc.collect()
    assert not eager_island._KEPT


def _tiny_llama(layers: int = 2) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            num_hidden_layers=layers,
            hidden_size=32,
            intermediate_size=48,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=VOCAB,
            bos_token_id=0,
            eos_token_id=0,
        )
    )


def _config(**compile_section: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.0,
        "steps_per_print": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
    }
    if compile_section:
        cfg["compile"] = compile_section
    return cfg


def _losses(engine: Any, steps: int = 2) -> list[float]:
    g = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss)
        engine.step()
        losses.append(float(out.loss.detach()))
    return losses


def test_blocks_share_one_graph_and_the_monitor_reports_it() -> None:
    eager = slipstream.initialize(_tiny_llama(4), _config())
    expected = _losses(eager, 3)
    eager.close()
    engine = slipstream.initialize(_tiny_llama(4), _config(enabled=True))  # use_cache is on: caches are dropped
    assert engine.is_compiled
    assert _losses(engine, 3) == pytest.approx(expected, rel=1e-6)
    last = engine.monitor.last
    assert last["compile/graphs"] == 2.0, f"four layers should be one graph, the loss another: {last}"
    assert last["compile/graph_breaks"] == 0.0 and last["compile/recompiles"] == 0.0
    assert last["compile/seconds"] > 0.0
    with torch.no_grad():  # an evaluation makes its own graph once: not a recompile
        engine(input_ids=torch.randint(0, VOCAB, (2, SEQ)), use_cache=False)
    _losses(engine, 1)
    last = engine.monitor.last
    assert last["compile/graphs"] == 3.0 and last["compile/recompiles"] == 0.0, last
    _losses(engine, 1)
    engine.module.train(False)  # a guard the first graphs did not have (training mode off): that is a recompile
    _losses(engine, 1)
    assert engine.monitor.last["compile/recompiles"] >= 1.0, engine.monitor.last
    engine.close()


@pytest.mark.parametrize("tiled", [False, True])
def test_the_loss_is_compiled_unless_off_or_tiled(tiled: bool) -> None:
    """[Note: the loss is compiled too]: the model's loss_function runs compiled (a graph of its own, eager's losses);
    ``compile.loss: false`` and tiled logits leave it as it was; ``close`` gives the model its own back."""
    extra = {"long_context": {"tiled_logits": {"enabled": True, "tile_tokens": 8}}} if tiled else {}
    eager = slipstream.initialize(_tiny_llama(), {**_config(), **extra})
    expected = _losses(eager)
    eager.close()
    saved: dict[bool, int] = {}
    for loss_on in (True, False):
        model = _tiny_llama()
        own = model.loss_function
        engine = slipstream.initialize(model, {**_config(enabled=True, loss=loss_on), **extra})
        compiled = loss_on and not tiled
        assert engine.parallel.compiled.loss_compiled is compiled
        assert (model.loss_function is not own) is (compiled or tiled)
        assert _losses(engine) == pytest.approx(expected, rel=1e-6)
        assert engine.monitor.last["compile/graphs"] == (2.0 if compiled else 1.0), engine.monitor.last
        saved[loss_on] = _saved_for_backward(engine)
        engine.close()
        assert "_loss_function" not in model.__dict__ and model.loss_function == own, "close() left the loss replaced"
    # What the step keeps for its backward: eager cross entropy keeps the fp32 log-probabilities, [tokens x vocab];
    # the compiled one a few bytes per token (a log-sum-exp). Counted exactly, unlike a sampled peak.
    logits_bytes = 2 * SEQ * VOCAB * 4
    if tiled:
        assert saved[True] == saved[False], saved
    else:
        assert saved[False] - saved[True] >= 0.9 * logits_bytes, (saved, logits_bytes)


def _saved_for_backward(engine: Any) -> int:
    """Bytes of the tensors autograd saves during one training forward (each storage once), less the logits (the
    model's output, alive anyway)."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = engine(input_ids=ids, labels=ids)
    storages.pop(out.logits.untyped_storage().data_ptr(), None)
    engine.backward(out.loss)
    engine.step()
    return sum(storages.values())


class _Broken(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x).relu()
        torch._dynamo.graph_break()
        return y + x


class _Stack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(_Broken() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def test_a_graph_break_is_counted_and_named(capsys: pytest.CaptureFixture[str]) -> None:
    engine = slipstream.initialize(_Stack(), _config(enabled=True, backend="aot_eager"))
    loss = engine(torch.randn(2, 16))
    engine.backward(loss)
    engine.step()
    assert engine.monitor.last["compile/graph_breaks"] >= 1.0
    assert "compile: _Broken breaks its graph" in capsys.readouterr().err
    engine.close()


def test_fullgraph_turns_a_break_into_an_error() -> None:
    engine = slipstream.initialize(_Stack(), _config(enabled=True, backend="aot_eager", kwargs={"fullgraph": True}))
    with pytest.raises(Exception, match="graph_break"):
        engine(torch.randn(2, 16))
    engine.close()


def test_a_model_compiled_before_initialize_is_unwrapped() -> None:
    eager = slipstream.initialize(_tiny_llama(), _config())
    expected = _losses(eager)
    eager.close()
    model = _tiny_llama()
    engine = slipstream.initialize(torch.compile(model), _config())
    assert engine.module is model and engine.is_compiled
    assert _losses(engine) == pytest.approx(expected, rel=1e-6)
    assert not [k for k in engine.consolidated_state_dict() if "_orig_mod" in k]
    engine.close()


def test_engine_compile_keeps_checkpointing_around_the_compiled_forward() -> None:
    cfg = {**_config(), "activation_checkpointing": {"module_classes": ["LlamaDecoderLayer"]}}
    eager = slipstream.initialize(_tiny_llama(), cfg)
    expected = _losses(eager)
    eager.close()
    engine = slipstream.initialize(_tiny_llama(), cfg)
    assert not engine.is_compiled
    engine.compile(backend="aot_eager")
    layers = engine.module.model.layers
    assert all("_slipstream_checkpointed_forward" in layer.__dict__ for layer in layers)
    assert _losses(engine) == pytest.approx(expected, rel=1e-6)
    assert engine.monitor.last["compile/graphs"] >= 1.0
    engine.close()
    assert all("forward" not in layer.__dict__ for layer in layers), "close() left a wrapped forward behind"


@pytest.mark.parametrize(
    "section,match",
    [
        ({"enabled": True, "backend": "inductr"}, r"compile.backend: 'inductr' is not a torch.compile backend"),
        ({"enabled": True, "kwargs": {"fullgrahp": True}}, r"compile.kwargs.*fullgrahp: not a torch.compile argument"),
        ({"enabled": True, "module_classes": ["GPT2Block"]}, r"compile.module_classes: no module of class GPT2Block"),
    ],
)
def test_config_mistakes_name_the_key(section: dict[str, Any], match: str) -> None:
    with pytest.raises(slipstream.ConfigError, match=match):
        slipstream.initialize(_tiny_llama(), _config(**section))


def test_deepcompile_turns_compiling_on_and_its_knobs_have_no_effect(capsys: pytest.CaptureFixture[str]) -> None:
    engine = slipstream.initialize(
        _tiny_llama(), _config(deepcompile=True, offload_activation=True, backend="aot_eager")
    )
    assert engine.is_compiled
    assert "compile.offload_activation = True has no effect" in capsys.readouterr().err
    engine.close()
