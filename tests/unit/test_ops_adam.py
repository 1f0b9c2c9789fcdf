"""CPU Adam op and its fallback against torch.optim.AdamW / Adam: per step, trajectories, copies.

"Relative" below is elementwise against the magnitudes the step works with: |ours - torch| <=
rtol * max(|torch|, |before|). The compiled kernel follows torch's arithmetic order; the only
difference left is torch's sqrt (MKL's, not always correctly rounded), an ulp in the denominator.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch

from slipstream.ops import builder
from slipstream.ops.adam import CPUAdam, FusedAdam, cpu_adam_step, torch_adam_step
from slipstream.ops.specs import CPU_ADAM

GROUPS = [  # several param groups, each overriding some defaults
    dict(lr=1e-3, weight_decay=0.01),
    dict(lr=3e-2, betas=(0.8, 0.99), weight_decay=0.1),
    dict(lr=5e-4, eps=1e-6, weight_decay=0.0),
]
SHAPES = [(1,), (15,), (17,), (33, 7), (1000,), (4099,), (70001,)]


@pytest.fixture(scope="module")
def op():
    """The compiled op. A machine with a compiler must build it: failing to is a test failure."""
    if builder.status(CPU_ADAM).state == "fallback":
        pytest.skip(f"CPU Adam cannot be built here: {builder.status(CPU_ADAM).detail}")
    module = builder.load(CPU_ADAM)
    assert module is not None, builder.loaded_status(CPU_ADAM)
    return module


def random_shapes(seed: int, count: int) -> list[tuple[int, ...]]:
    """Hypothesis-style shapes: odd sizes, tails that are not multiples of 16 or 8, some large."""
    rng = random.Random(seed)
    shapes = []
    for _ in range(count):
        kind = rng.random()
        if kind < 0.4:
            shapes.append((rng.randint(1, 40),))
        elif kind < 0.8:
            shapes.append((rng.randint(1, 70), rng.randint(1, 70)))
        else:
            shapes.append((rng.randint(40_000, 140_000) | 1,))
    return shapes


def make_params(shapes, seed=0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in shapes]


def split_groups(params, groups=GROUPS) -> list[dict]:
    return [dict(params=params[i :: len(groups)], **options) for i, options in enumerate(groups)]


def set_grads(params_a, params_b, step: int) -> None:
    generator = torch.Generator().manual_seed(1000 + step)
    for a, b in zip(params_a, params_b):
        grad = torch.randn(a.shape, generator=generator) * (0.1 + step % 3)
        a.grad, b.grad = grad.clone(), grad.clone()


def assert_step_close(ours: torch.Tensor, ref: torch.Tensor, before: torch.Tensor, rtol: float) -> None:
    bound = rtol * torch.maximum(ref.abs(), before.abs())
    excess = ((ours - ref).abs() - bound).max().item()
    assert excess <= 0, f"off by more than {rtol} relative (excess {excess:.3g})"


def assert_trajectory_close(ours: torch.Tensor, ref: torch.Tensor, rtol: float) -> None:
    error = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert error <= rtol, f"trajectory off by {error:.3g} relative"


def torch_optimizer(params, adamw: bool, groups=GROUPS):
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    return cls(split_groups(params, groups), foreach=False, weight_decay=0.0)


@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam-l2"])
@pytest.mark.parametrize("use_op", [True, False], ids=["kernel", "fallback"])
def test_each_step_matches_torch_from_the_same_state(op, adamw, use_op, monkeypatch):
    if not use_op:
        monkeypatch.setitem(builder._loaded, CPU_ADAM, (None, builder.OpStatus("fallback", "test")))
    shapes = SHAPES + random_shapes(seed=1, count=12)
    ours, ref = make_params(shapes), make_params(shapes)
    optimizer = CPUAdam(split_groups(ours), adamw_mode=adamw)
    reference = torch_optimizer(ref, adamw)
    for step in range(1, 6):
        set_grads(ours, ref, step)
        before = [p.detach().clone() for p in ref]
        optimizer.step()
        reference.step()
        for a, b, b0 in zip(ours, ref, before):
            assert_step_close(a.detach(), b.detach(), b0, 1e-6)
            sa, sb = optimizer.state[a], reference.state[b]
            assert_step_close(sa["exp_avg"], sb["exp_avg"], sb["exp_avg"], 1e-6)
            assert_step_close(sa["exp_avg_sq"], sb["exp_avg_sq"], sb["exp_avg_sq"], 1e-6)
            assert sa["step"] == sb["step"].item() == step
        with torch.no_grad():  # restart the next step from torch's exact state
            for a, b in zip(ours, ref):
                a.copy_(b)
                optimizer.state[a]["exp_avg"].copy_(reference.state[b]["exp_avg"])
                optimizer.state[a]["exp_avg_sq"].copy_(reference.state[b]["exp_avg_sq"])


@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam-l2"])
def test_hundred_step_trajectory_matches_torch(op, adamw):
    # Gradients depend on the parameters (a least-squares fit), so errors can feed back.
    generator = torch.Generator().manual_seed(7)
    shapes = [(64, 33), (33,), (1, 64), (257,)]
    targets = [torch.randn(shape, generator=generator) for shape in shapes]
    ours, ref = make_params(shapes, seed=3), make_params(shapes, seed=3)
    optimizer = CPUAdam(split_groups(ours), adamw_mode=adamw)
    reference = torch_optimizer(ref, adamw)
    for _ in range(100):
        for params, opt in ((ours, optimizer), (ref, reference)):
            opt.zero_grad()
            loss = sum(((p - t) ** 2).sum() for p, t in zip(params, targets))
            loss.backward()
            opt.step()
    for a, b, start in zip(ours, ref, make_params(shapes, seed=3)):
        assert_trajectory_close(a.detach(), b.detach(), 1e-5)
        assert (a - start).abs().max() > 0.02  # it did train


def _state(shapes, seed):
    generator = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=generator) for s in shapes]
    exp_avgs = [torch.randn(s, generator=generator) * 0.1 for s in shapes]
    exp_avg_sqs = [torch.rand(s, generator=generator) * 0.01 for s in shapes]
    return params, exp_avgs, exp_avg_sqs


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("lowp_dtype", [torch.bfloat16, torch.float16])
def test_offload_step_low_precision_grads_scale_and_copy(op, grad_dtype, lowp_dtype):
    shapes = random_shapes(seed=11, count=10)
    params, exp_avgs, exp_avg_sqs = _state(shapes, seed=5)
    ref = [p.clone().requires_grad_() for p in params]
    generator = torch.Generator().manual_seed(6)
    grads = [(torch.randn(s, generator=generator) * 64).to(grad_dtype) for s in shapes]
    grad_copies = [g.clone() for g in grads]
    lowp = [torch.empty(s, dtype=lowp_dtype) for s in shapes]
    hyper = dict(step=4, lr=2e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05)
    scale = 1 / 64 * 0.7  # unscale x clip coefficient
    cpu_adam_step(params, grads, exp_avgs, exp_avg_sqs, grad_scale=scale, out_lowp=lowp, **hyper)

    reference = torch.optim.AdamW(ref, lr=2e-3, weight_decay=0.05, foreach=False)
    _, ref_avgs, ref_avg_sqs = _state(shapes, seed=5)
    for p, g, m, v in zip(ref, grads, ref_avgs, ref_avg_sqs):
        p.grad = g.float() * scale
        reference.state[p] = {"step": torch.tensor(3.0), "exp_avg": m, "exp_avg_sq": v}
    before = [p.detach().clone() for p in ref]
    reference.step()
    for ours, theirs, b0, copy, g, g0 in zip(params, ref, before, lowp, grads, grad_copies):
        assert_step_close(ours, theirs.detach(), b0, 1e-6)
        assert torch.equal(copy.view(torch.int16), ours.to(lowp_dtype).view(torch.int16))
        assert torch.equal(g, g0)  # gradients are read only


@pytest.mark.parametrize("isa", ["native", "avx2", "scalar"])
def test_low_precision_copy_rounds_every_bit_pattern_like_torch(op, isa):
    # lr=0 and zero grads leave p as it is, so the copy is the conversion of arbitrary floats:
    # ties, subnormals, overflow to inf, inf and NaN included.
    code = textwrap.dedent("""
        import torch
        from slipstream.ops.adam import cpu_adam_step
        bits = torch.randint(-2**31, 2**31 - 1, (1 << 16,), generator=torch.Generator().manual_seed(2), dtype=torch.int64)
        special = torch.tensor([0x7F800000, 0xFF800000, 0x7FC00000, 0x00000001, 0x807FFFFF, 0x477FF000, 0x477FEFFF,
                                0x3F808000, 0x3F818000, 0x33000000, 0x33000001, 0x387FE000], dtype=torch.int64)
        bits = torch.cat([special, bits, special + 1]).to(torch.int32)
        for dtype in (torch.bfloat16, torch.float16):
            p = bits.view(torch.float32).clone()
            expected = p.to(dtype)
            out = torch.empty_like(expected)
            zeros = torch.zeros_like(p)
            cpu_adam_step([p], [zeros.clone()], [zeros.clone()], [zeros.clone()], step=1, lr=0.0, beta1=0.9,
                          beta2=0.999, eps=1e-8, weight_decay=0.0, out_lowp=[out])
            same = out.view(torch.int16) == expected.view(torch.int16)
            both_nan = out.isnan() & expected.isnan()
            assert bool((same | both_nan).all()), (dtype, p[~(same | both_nan)][:5], out[~(same | both_nan)][:5])
            kept = (p.view(torch.int32) == bits) | p.isnan()
            assert bool(kept.all()), "lr=0 must leave the parameters as they were"
    """)
    env = {k: v for k, v in os.environ.items() if k != "SLIPSTREAM_CPU_ADAM_ISA"}
    if isa != "native":
        env["SLIPSTREAM_CPU_ADAM_ISA"] = isa
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


def test_every_isa_gives_the_same_bits(op):
    code = textwrap.dedent("""
        import hashlib, torch
        from slipstream.ops import builder
        from slipstream.ops.adam import cpu_adam_step
        from slipstream.ops.specs import CPU_ADAM
        g = torch.Generator().manual_seed(0)
        shapes = [(1,), (7,), (15,), (17,), (100,), (40_001,)]
        params = [torch.randn(s, generator=g) for s in shapes]
        grads = [torch.randn(s, generator=g).bfloat16() for s in shapes]
        m = [torch.randn(s, generator=g) * 0.1 for s in shapes]
        v = [torch.rand(s, generator=g) * 0.01 for s in shapes]
        out = [torch.empty(s, dtype=torch.bfloat16) for s in shapes]
        for adamw in (True, False):
            cpu_adam_step(params, grads, m, v, step=3, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1,
                          adamw_mode=adamw, grad_scale=0.5, out_lowp=out)
        digest = hashlib.sha256()
        for t in params + m + v + out:
            digest.update(t.view(torch.int16).numpy().tobytes())
        print(builder.load(CPU_ADAM).isa(), digest.hexdigest())
    """)
    results = {}
    for isa in ("native", "avx2", "scalar"):
        env = {k: v for k, v in os.environ.items() if k != "SLIPSTREAM_CPU_ADAM_ISA"}
        if isa != "native":
            env["SLIPSTREAM_CPU_ADAM_ISA"] = isa
        out = subprocess.run(
            [sys.executable, "-c", code], check=True, env=env, capture_output=True, text=True, timeout=120
        )
        used, digest = out.stdout.split()
        results[used] = digest
    assert "scalar" in results, results
    assert len(set(results.values())) == 1, results


def test_fallback_function_matches_kernel(op):
    shapes = random_shapes(seed=21, count=8)
    for grad_dtype in (torch.float32, torch.bfloat16):
        a_state, b_state = _state(shapes, seed=9), _state(shapes, seed=9)
        generator = torch.Generator().manual_seed(10)
        grads = [torch.randn(s, generator=generator).to(grad_dtype) for s in shapes]
        outs = [[torch.empty(s, dtype=torch.bfloat16) for s in shapes] for _ in range(2)]
        hyper = dict(step=2, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, grad_scale=0.5)
        cpu_adam_step(*a_state[:1], grads, *a_state[1:], out_lowp=outs[0], **hyper)
        torch_adam_step(*b_state[:1], grads, *b_state[1:], out_lowp=outs[1], **hyper)
        before = _state(shapes, seed=9)[0]
        for a, b, b0 in zip(a_state[0], b_state[0], before):
            assert_step_close(a, b, b0, 1e-6)


def test_thread_counts_agree_bitwise(op):
    shapes = [(123_457,), (99,), (65_536,)]
    results = []
    for threads in (1, 2, 3):
        params, m, v = _state(shapes, seed=4)
        grads = [torch.full(s, 0.25) for s in shapes]
        cpu_adam_step(
            params,
            grads,
            m,
            v,
            step=1,
            lr=1e-3,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.0,
            num_threads=threads,
        )
        results.append(torch.cat(params + m + v))
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def test_optimizer_api_state_dict_and_torch_interchange(op):
    model = torch.nn.Linear(5, 3)
    optimizer = CPUAdam(
        [{"params": [model.weight]}, {"params": [model.bias], "lr": 1e-2, "weight_decay": 0.1}], lr=1e-3
    )
    assert optimizer.param_groups[0]["lr"] == 1e-3 and optimizer.param_groups[0]["adamw_mode"] is True
    assert optimizer.param_groups[1]["weight_decay"] == 0.1
    model(torch.randn(4, 5)).sum().backward()
    optimizer.step()
    state = optimizer.state_dict()
    twin = torch.nn.Linear(5, 3)
    twin.load_state_dict(model.state_dict())
    reloaded = torch.optim.AdamW([{"params": [twin.weight]}, {"params": [twin.bias]}])
    reloaded.load_state_dict(state)  # same state keys as torch's Adam
    assert torch.equal(reloaded.state[twin.weight]["exp_avg"], optimizer.state[model.weight]["exp_avg"])


def test_optimizer_rejects_what_it_cannot_do():
    with pytest.raises(ValueError, match="betas"):
        CPUAdam([torch.nn.Parameter(torch.zeros(2))], betas=(1.0, 0.999))
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.zeros(3).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        CPUAdam([p]).step()


def test_fused_adam_without_cuda_steps_cpu_params_like_cpu_adam(op):
    shapes = [(10, 3), (31,)]
    a, b = make_params(shapes), make_params(shapes)
    fused, cpu = FusedAdam(a, lr=1e-2, weight_decay=0.1), CPUAdam(b, lr=1e-2, weight_decay=0.1)
    for step in range(3):
        set_grads(a, b, step)
        fused.step()
        cpu.step()
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_bf16_params_take_the_float32_state_path(op):
    p = torch.nn.Parameter(torch.randn(50).bfloat16())
    ref = torch.nn.Parameter(p.detach().float().clone())
    optimizer, reference = CPUAdam([p], lr=1e-2), torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.0, foreach=False)
    g = torch.randn(50)
    p.grad, ref.grad = g.bfloat16(), g.bfloat16().float()
    optimizer.step()
    reference.step()
    assert optimizer.state[p]["exp_avg"].dtype == torch.float32
    torch.testing.assert_close(p.detach().float(), ref.detach().bfloat16().float(), rtol=2**-8, atol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_fused_adam_on_cuda_matches_the_cpu_kernel_and_the_engine_picks_it(op):
    from slipstream.engine.config import OptimizerConfig
    from slipstream.engine.optimizers import build_optimizer
    from slipstream.ops.adam import fused_adam_available, fused_adam_step

    assert fused_adam_available()
    shapes = random_shapes(seed=31, count=12)
    cpu, gpu = make_params(shapes), [torch.nn.Parameter(p.detach().cuda()) for p in make_params(shapes)]
    cpu_opt, gpu_opt = CPUAdam(split_groups(cpu)), FusedAdam(split_groups(gpu))
    for step in range(1, 4):
        set_grads(cpu, cpu, step)
        for a, b in zip(cpu, gpu):
            b.grad = a.grad.cuda()
        cpu_opt.step()
        gpu_opt.step()
    for a, b in zip(cpu, gpu):  # same operations, each correctly rounded, on both devices
        assert torch.equal(a.detach(), b.detach().cpu())
    params, m, v = (ts for ts in _state(shapes, seed=2))
    grads = [torch.randn(s).bfloat16() for s in shapes]
    outs = [[torch.empty(s, dtype=torch.bfloat16) for s in shapes] for _ in range(2)]
    hyper = dict(step=2, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, grad_scale=0.5)
    cuda_state = [[t.cuda() for t in ts] for ts in (params, m, v)]
    cuda_out = [t.cuda() for t in outs[1]]
    fused_adam_step(cuda_state[0], [g.cuda() for g in grads], cuda_state[1], cuda_state[2], out_lowp=cuda_out, **hyper)
    cpu_adam_step(params, grads, m, v, out_lowp=outs[0], **hyper)
    for a, b in zip(outs[0], cuda_out):
        assert torch.equal(a, b.cpu())
    engine_opt = build_optimizer(OptimizerConfig(type="AdamW", params={"lr": 1e-3}), [{"params": gpu}], True)
    assert isinstance(engine_opt, FusedAdam)
