"""Gradient arrivals (engine/zero/arrivals.py): the compiled op and its Python fallback do the same thing to each
gradient, mark the same flags, launch the same buckets, and raise the same error on a gradient that arrives twice."""

from __future__ import annotations

import pytest
import torch

from slipstream.engine.zero.arrivals import ADD_AND_FREE, ADOPT, COUNT, PythonArrivals
from slipstream.engine.zero.ordered_launch import OrderedLauncher
from slipstream.errors import UsageError
from slipstream.ops import builder
from slipstream.ops.specs import GRAD_ARRIVALS


def _compiled() -> type:
    op = builder.load(GRAD_ARRIVALS)
    assert op is not None, "the gradient-arrivals op did not build (scripts/setup.sh builds it)"
    return op.GradArrivals


KINDS = {"compiled": _compiled, "python": lambda: PythonArrivals}


class _Three(torch.nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Parameter(torch.randn(3, dtype=dtype))
        self.b = torch.nn.Parameter(torch.randn(3, dtype=dtype))
        self.c = torch.nn.Parameter(torch.randn(3, dtype=dtype))  # unused unless asked

    def forward(self, x: torch.Tensor, use_c: bool = False) -> torch.Tensor:
        out = (self.a * x).sum() + (self.b * x * x).sum()
        return out + self.c.sum() if use_c else out


def _attach(kind: str, model: _Three, mode: int, views: list[torch.Tensor], used: bytearray, launched: list[int]):
    params = [model.a, model.b, model.c]
    launcher = OrderedLauncher([[0, 1], [2]], lambda index, waited: launched.append(index))
    arrivals = KINDS[kind]()(params, [0, 1, 2], views, mode, [0, 0, 1], 2, used, launcher.complete, launcher.twice)
    return arrivals, launcher


@pytest.mark.parametrize("kind", KINDS)
def test_adopt_keeps_grad_the_buffer_view_and_counts_buckets(kind: str) -> None:
    model = _Three()
    flat = torch.zeros(9)
    views = [flat[3 * i : 3 * i + 3] for i in range(3)]
    used, launched = bytearray(3), []
    arrivals, launcher = _attach(kind, model, ADOPT, views, used, launched)
    assert arrivals.hooks() == 3
    for p, view in zip((model.a, model.b, model.c), views):
        p.grad = view
    x = torch.tensor([1.0, 2.0, 3.0])
    arrivals.sync = True
    model(x).backward()
    assert model.a.grad is views[0] and model.b.grad is views[1]  # accumulated in place, in the buffer
    torch.testing.assert_close(flat[:6], torch.cat([x, x * x]))
    assert bytes(used) == b"\x01\x01\x00"  # c got no gradient
    assert launched == [0]  # bucket 0 is complete and first: it launches from the hook
    launcher.flush()  # bucket 1 (c unused) at the flush
    assert launched == [0, 1]
    # A gradient autograd allocated afresh (a user's zero_grad(set_to_none=True)) is copied into the view.
    arrivals.reset()
    launcher.reset()
    flat.zero_()
    model.a.grad = None
    model(x).backward()
    assert model.a.grad is views[0]
    torch.testing.assert_close(views[0], x)


@pytest.mark.parametrize("kind", KINDS)
def test_a_complete_bucket_launches_from_the_hook(kind: str) -> None:
    model = _Three()
    used, launched = bytearray(3), []
    arrivals, _ = _attach(kind, model, COUNT, [], used, launched)
    arrivals.sync = True
    model(torch.ones(3), use_c=True).backward()
    assert launched == [0]  # bucket 0 from the hook; the last (bucket 1) waits for the flush
    assert model.c.grad is not None and bytes(used) == b"\x01\x01\x01"  # COUNT leaves the gradient where it is
    # Without overlap, nothing launches from the hook.
    arrivals.reset()
    launched.clear()
    arrivals.launch = False
    model(torch.ones(3), use_c=True).backward()
    assert launched == []


@pytest.mark.parametrize("kind", KINDS)
def test_add_and_free_accumulates_low_precision_gradients_in_fp32(kind: str) -> None:
    model = _Three(torch.bfloat16)
    flat = torch.zeros(9)
    views = [flat[3 * i : 3 * i + 3] for i in range(3)]
    used, launched = bytearray(3), []
    arrivals, _ = _attach(kind, model, ADD_AND_FREE, views, used, launched)
    x = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)
    for _ in range(2):  # accumulation without sync: no counting, no error for a second arrival
        model(x).backward()
    assert model.a.grad is None and model.b.grad is None  # freed as it arrived
    torch.testing.assert_close(flat[:6], 2 * torch.cat([x, x * x]).float())
    assert launched == []


@pytest.mark.parametrize("kind", KINDS)
def test_a_gradient_arriving_twice_in_a_sync_window_is_the_launchers_error(kind: str) -> None:
    model = _Three()
    used, launched = bytearray(3), []
    arrivals, _ = _attach(kind, model, COUNT, [], used, launched)
    arrivals.sync = True
    model(torch.ones(3)).backward()
    with pytest.raises(UsageError, match="arrived twice"):
        model(torch.ones(3)).backward()


@pytest.mark.parametrize("kind", KINDS)
def test_aside_and_remove(kind: str) -> None:
    model = _Three()
    used, launched = bytearray(3), []
    arrivals, _ = _attach(kind, model, COUNT, [], used, launched)
    arrivals.aside = True
    model(torch.ones(3)).backward()
    assert bytes(used) == b"\x00\x00\x00"
    arrivals.aside = False
    arrivals.remove()
    assert arrivals.hooks() == 0
    model(torch.ones(3)).backward()
    assert bytes(used) == b"\x00\x00\x00" and model.a.grad is not None


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_closed_engine_is_collected(stage: int) -> None:
    """The hooks' callbacks lead back to the strategy that holds them; a C++ object hides that cycle from Python's
    collector, so ``remove`` lets go of them: a closed engine's buffers go with it."""
    import gc
    import weakref

    import slipstream

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "steps_per_print": 0,
        "zero_optimization": {"stage": stage, "partition_single_rank": True},  # the stage's own hooks on one process
    }
    model = _Three()
    engine = slipstream.initialize(model, config)
    engine.backward(engine(torch.ones(3)))
    engine.step()
    strategy = engine.strategy
    # what the bucket callback leads back to: stage 0's reducer, stages 1/2's partition (which holds the hooks: a cycle)
    owners = [weakref.ref(strategy), weakref.ref(strategy.reducer if stage == 0 else strategy.parts[0])]
    engine.close()
    del engine, strategy
    gc.collect()
    assert [owner() for owner in owners] == [None, None]


@pytest.mark.parametrize("stage", [0, 2])
def test_compiled_autograd_moves_the_hooks_to_python(stage: int) -> None:
    """[Note: compiled autograd traces Python hooks]: a backward under compiled autograd runs with the Python hooks
    (the C++ ones would fail it) and trains as the eager backward does."""
    import torch._dynamo.compiled_autograd as compiled_autograd

    import slipstream
    from slipstream.engine.zero.arrivals import PythonArrivals

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "gradient_clipping": 0.0,
        "steps_per_print": 0,
        "zero_optimization": {"stage": stage, "partition_single_rank": True},
    }
    x = torch.tensor([1.0, -2.0, 0.5])
    runs = []
    for compiled in (False, True):
        engine = slipstream.initialize(_Three(), config)
        hooked = engine.strategy.hooks[0]
        assert not isinstance(hooked.impl, PythonArrivals)
        for _ in range(2):
            loss = engine(x)
            if compiled:
                with compiled_autograd._enable(torch.compile(backend="eager")):
                    engine.backward(loss)
            else:
                engine.backward(loss)
            engine.step()
        assert isinstance(hooked.impl, PythonArrivals) == compiled
        runs.append([p.detach().clone() for p in engine.module.parameters()])
        engine.close()
    for eager, traced in zip(*runs):
        torch.testing.assert_close(traced, eager, rtol=0, atol=0)
