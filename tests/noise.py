"""Noise-aware weight tolerances: how far float noise alone can move each element of a reference's weights.

[Note: why a fixed tolerance is flaky] After a few AdamW steps, an element whose true gradient is
near zero moves by a fraction of the learning rate in a direction that rounding decides: Adam
divides the gradient by its own running magnitude, so a last-bit difference in a gradient of 1e-9
becomes a step of up to ``lr``. Two correct implementations that sum in different orders (data
parallel's reduce-scatter, tensor parallel's partial sums, a ring's blocks) disagree there by up to
``2·lr`` per step, and a fixed ``atol`` either lets real errors through or fails on a machine whose
rounding went the other way (a fresh machine failed the world-8 recipes by 5.8e-5 against 5e-5).

So the reference measures its own noise. At every step it computes the gradient twice at the same
weights, in float32 (what it trains with) and in float64 (the true gradient to ~1e-16); the largest
difference over a tensor, times a safety factor, bounds how far any correct float32 implementation's
gradient can be from the reference's. Two shadow AdamW states then replay the reference's steps
with every gradient pushed up, resp. down, by that bound; the distance of their weights from the
reference's is how far noise can carry each element. An element whose gradient stands clear of the
noise gets almost nothing (Adam's step barely moves when its gradient moves by 1e-7 relative); one
whose gradient sits at noise level gets up to ``2·lr`` a step. A wrong gradient sign on an element
that carries signal still fails, because its allowance stays at the base tolerance.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterable

import torch

# The float32 noise of a gradient measured once (float32 vs float64 at the same weights) stands for the
# noise of any float32 implementation: another summation order has errors of the same size, and the
# parallel run and the reference each have theirs (hence at least 2x); 8x leaves room for a tensor whose
# largest error was not sampled by this batch.
SAFETY = 8.0


@dataclasses.dataclass
class AdamW:
    """AdamW's hyper-parameters (``torch.optim.AdamW``'s defaults)."""

    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0


class NoiseShadows:
    """Two float64 AdamW shadows of a reference run, stepped with the reference's gradients ± their noise bound.

    Call :meth:`observe` once per optimizer step *before* the reference's own step, with the reference's
    parameters (their float32 ``.grad`` set) and the float64 model's parameters (same weights, float64
    ``.grad``); :meth:`bounds` gives the per-element allowance afterwards.
    """

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]], adam: AdamW) -> None:
        named = list(named)
        self.adam = adam
        self.names = [name for name, _ in named]
        self.step_count = 0
        self.state: dict[str, dict[str, torch.Tensor]] = {}
        for name, param in named:
            w = param.detach().double().clone()
            zero = torch.zeros_like(w)
            self.state[name] = {
                "w": w,
                "w_up": w.clone(),
                "w_down": w.clone(),
                "m": zero.clone(),
                "v": zero.clone(),
                "m_up": zero.clone(),
                "v_up": zero.clone(),
                "m_down": zero.clone(),
                "v_down": zero.clone(),
            }
        self.noise: dict[str, float] = dict.fromkeys(self.names, 0.0)

    def observe(
        self, grads32: dict[str, torch.Tensor | None], grads64: dict[str, torch.Tensor | None], clip_coef: float = 1.0
    ) -> None:
        """One step of the three trajectories from the reference's float32 gradients and the float64 ones at the same weights."""
        self.step_count += 1
        a, t = self.adam, self.step_count
        b1, b2 = a.betas
        bc1, bc2 = 1 - b1**t, 1 - b2**t
        for name in self.names:
            g32, g64 = grads32.get(name), grads64.get(name)
            if g32 is None:
                continue
            g = g32.double() * clip_coef
            scale = SAFETY * float((g32.double() - g64.double()).abs().max()) * clip_coef if g64 is not None else 0.0
            self.noise[name] = max(self.noise[name], scale)
            # an element nothing contributed to (an embedding row no token of the batch used) is exactly 0 in every
            # implementation: no noise there
            noise = scale if g64 is None else torch.where((g64 == 0) & (g32 == 0), 0.0, scale).double()
            s = self.state[name]
            for suffix, shift in (("", 0.0), ("_up", noise), ("_down", -noise)):
                w, m, v = s["w" + suffix], s["m" + suffix], s["v" + suffix]
                gg = g + shift
                w.mul_(1 - a.lr * a.weight_decay)
                m.mul_(b1).add_(gg, alpha=1 - b1)
                v.mul_(b2).addcmul_(gg, gg, value=1 - b2)
                w.addcdiv_(m, v.div(bc2).sqrt_().add_(a.eps), value=-a.lr / bc1)

    def bounds(self) -> dict[str, torch.Tensor]:
        """Per element, how far float noise alone can carry the weight from the reference's (float32 tensors)."""
        out = {}
        for name in self.names:
            s = self.state[name]
            out[name] = torch.maximum((s["w_up"] - s["w"]).abs(), (s["w_down"] - s["w"]).abs()).float()
        return out


def float64_twin(model: torch.nn.Module) -> torch.nn.Module:
    """A float64 copy of ``model`` whose weights :func:`sync_twin` keeps equal to the reference's.

    transformers' grouped-GEMM experts take no float64, so the twin's experts run their per-expert loop.
    """
    twin = copy.deepcopy(model).double()
    for module in twin.modules():
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "_experts_implementation", None) not in (None, "eager"):
            config._experts_implementation = "eager"
    return twin


def sync_twin(twin: torch.nn.Module, model: torch.nn.Module) -> None:
    with torch.no_grad():
        for ours, theirs in zip(twin.parameters(), model.parameters(), strict=True):
            ours.copy_(theirs)


def twin_grads(
    twin: torch.nn.Module, model: torch.nn.Module, loss_fn: Callable[[torch.nn.Module], torch.Tensor]
) -> dict[str, torch.Tensor | None]:
    """The float64 gradients of ``loss_fn`` at ``model``'s current weights, by the reference's parameter names."""
    sync_twin(twin, model)
    twin.zero_grad(set_to_none=True)
    loss_fn(twin).backward()
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: q.grad for p, q in zip(model.parameters(), twin.parameters(), strict=True)}


class WeightsWithBounds(dict):
    """A reference's final weights by name, carrying the per-element noise allowance (``bounds``) beside them."""

    bounds: dict[str, torch.Tensor]
    noise: dict[str, float]


def with_bounds(params: dict[str, torch.Tensor], shadows: NoiseShadows) -> WeightsWithBounds:
    out = WeightsWithBounds(params)
    out.bounds = shadows.bounds()
    out.noise = dict(shadows.noise)
    return out


def assert_weights_close(
    ours: dict[str, torch.Tensor],
    reference: dict[str, torch.Tensor],
    rtol: float = 1e-4,
    atol: float = 5e-5,
    label: str = "",
) -> None:
    """Every reference weight within ``atol + rtol·|ref|`` of ours, plus the reference's noise allowance where it has one.

    A ``reference`` without bounds (a plain dict) is compared with the fixed tolerance alone.
    """
    bounds = getattr(reference, "bounds", {})
    for name, ref in reference.items():
        value = ours[name].detach().float().reshape(ref.shape)
        ref = ref.detach().float()
        allowed = atol + rtol * ref.abs() + bounds.get(name, torch.zeros_like(ref))
        diff = (value - ref).abs()
        bad = diff > allowed
        if bool(bad.any()) or not bool(torch.isfinite(value).all()):
            i = int(torch.argmax(torch.where(bad, diff - allowed, torch.full_like(diff, -1.0))))
            flat_diff, flat_allowed = diff.flatten(), allowed.flatten()
            noise = bounds[name].flatten()[i] if name in bounds else 0.0
            raise AssertionError(
                f"{label + ' ' if label else ''}{name}: {int(bad.sum())} of {ref.numel()} elements off; worst at flat index {i}: "
                f"{float(value.flatten()[i])!r} vs reference {float(ref.flatten()[i])!r}, off by {float(flat_diff[i]):.3g}, "
                f"allowed {float(flat_allowed[i]):.3g} (atol {atol:g} + rtol {rtol:g}·|ref| + noise allowance {float(noise):.3g})"
            )
