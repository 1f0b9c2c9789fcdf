"""Adam/AdamW on compiled kernels: ``CPUAdam``, ``FusedAdam`` and the one-pass step functions.

``adamw_mode=True`` (the default) is decoupled weight decay, as ``torch.optim.AdamW``;
``adamw_mode=False`` adds ``weight_decay * param`` to the gradient, as ``torch.optim.Adam``.
``weight_decay`` defaults to 0, as in DeepSpeed. Results match torch's single-tensor AdamW to
about an ulp per step (see csrc/adam/cpu_adam.cpp).

[Note: one pass for offload] ``cpu_adam_step`` takes low-precision gradients and a scalar
``grad_scale`` (loss-scale unscale x clip coefficient) and can write a bf16/fp16 copy of the
updated parameters, all in the pass that updates the fp32 master weights and Adam state — the
offload path needs no separate unscale, cast or copy pass.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from slipstream.ops import builder
from slipstream.ops.specs import CPU_ADAM, FUSED_ADAM

__all__ = [
    "CPUAdam",
    "FusedAdam",
    "cpu_adam_available",
    "fused_adam_available",
    "cpu_adam_step",
    "fused_adam_step",
    "torch_adam_step",
]

Tensors = Sequence[torch.Tensor]


def cpu_adam_available() -> bool:
    """True when the compiled CPU Adam op is loaded (building or fetching it from the cache)."""
    return builder.load(CPU_ADAM) is not None


def fused_adam_available() -> bool:
    """True when CUDA is usable and the compiled fused CUDA Adam op is loaded."""
    return torch.cuda.is_available() and builder.load(FUSED_ADAM) is not None


def cpu_adam_step(
    params: Tensors,
    grads: Tensors,
    exp_avgs: Tensors,
    exp_avg_sqs: Tensors,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw_mode: bool = True,
    grad_scale: float = 1.0,
    out_lowp: Tensors | None = None,
    num_threads: int | None = None,
) -> None:
    """One Adam step, in place, over contiguous CPU tensors of one param group.

    ``params``, ``exp_avgs``, ``exp_avg_sqs`` are float32; ``grads`` share one dtype of float32,
    bfloat16 or float16 and are read only, multiplied by ``grad_scale``; ``step`` counts this
    update (1 on the first); ``out_lowp`` (optional, bfloat16 or float16) receives the updated
    parameters rounded to nearest even. Runs the compiled kernel, else :func:`torch_adam_step`.
    """
    op = builder.load(CPU_ADAM)
    threads = num_threads if num_threads is not None else torch.get_num_threads()
    _step(
        op,
        (threads,),
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        step,
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        adamw_mode,
        grad_scale,
        out_lowp,
    )


def fused_adam_step(
    params: Tensors,
    grads: Tensors,
    exp_avgs: Tensors,
    exp_avg_sqs: Tensors,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw_mode: bool = True,
    grad_scale: float = 1.0,
    out_lowp: Tensors | None = None,
) -> None:
    """``cpu_adam_step`` for CUDA tensors: the multi-tensor CUDA kernel on the current stream.

    Parameters may be float32, bfloat16 or float16 (state is float32; grads float32 or the
    parameters' dtype). Without the compiled op it runs :func:`torch_adam_step`.
    """
    op = builder.load(FUSED_ADAM) if torch.cuda.is_available() else None
    _step(
        op,
        (),
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        step,
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        adamw_mode,
        grad_scale,
        out_lowp,
    )


def _step(
    op: Any,
    extra: tuple[Any, ...],
    params: Tensors,
    grads: Tensors,
    exp_avgs: Tensors,
    exp_avg_sqs: Tensors,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw_mode: bool,
    grad_scale: float,
    out_lowp: Tensors | None,
) -> None:
    """Run the compiled op's ``adam_step`` (with its ``extra`` trailing arguments) or the fallback."""
    if op is None:
        torch_adam_step(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            step=step,
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            eps=eps,
            weight_decay=weight_decay,
            adamw_mode=adamw_mode,
            grad_scale=grad_scale,
            out_lowp=out_lowp,
        )
        return
    op.adam_step(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        out_lowp or [],
        step,
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        adamw_mode,
        grad_scale,
        *extra,
    )


def torch_adam_step(
    params: Tensors,
    grads: Tensors,
    exp_avgs: Tensors,
    exp_avg_sqs: Tensors,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw_mode: bool = True,
    grad_scale: float = 1.0,
    out_lowp: Tensors | None = None,
) -> None:
    """The pure-PyTorch path of :func:`cpu_adam_step` (any device; float32 state).

    Parameters of another dtype are updated through a float32 copy. Uses torch's fused Adam
    kernel (CPU and CUDA since torch 2.4).
    """
    if not params:
        return
    grads32 = [g.float() for g in grads]  # a copy for low-precision grads, the tensor itself for float32
    if grad_scale != 1.0:
        if any(g32 is g for g32, g in zip(grads32, grads)):
            grads32 = torch._foreach_mul(grads32, grad_scale)  # never scale the caller's gradients in place
        else:
            torch._foreach_mul_(grads32, grad_scale)
    params32 = [p.float() for p in params]
    state_steps = [torch.tensor(float(step), device=params[0].device)] * len(params)
    options = dict(lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)
    fused = torch._fused_adamw_ if adamw_mode else torch._fused_adam_
    fused(params32, grads32, list(exp_avgs), list(exp_avg_sqs), [], state_steps, **options)
    for p, p32 in zip(params, params32):
        if p32 is not p:
            p.copy_(p32)
    if out_lowp:
        torch._foreach_copy_(list(out_lowp), params32)


def evaluate_closure(closure: Any) -> Any:
    """``optimizer.step(closure)``'s contract: re-evaluate the loss with gradients enabled, if given."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class _Adam(torch.optim.Optimizer):
    """Shared body of CPUAdam and FusedAdam: state layout as torch's Adam, float32 state always."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adamw_mode: bool = True,
        *,
        num_threads: int | None = None,
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"{type(self).__name__}: lr must be >= 0, got {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"{type(self).__name__}: betas must be in [0, 1), got {betas}")
        if not eps >= 0.0 or not weight_decay >= 0.0:
            raise ValueError(f"{type(self).__name__}: eps and weight_decay must be >= 0, got {eps}, {weight_decay}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, adamw_mode=adamw_mode)
        super().__init__(params, defaults)
        self.num_threads = num_threads

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = evaluate_closure(closure)
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def _step_group(self, group: dict[str, Any]) -> None:
        # One kernel call per (device, dtypes, step): all of a group's tensors in the usual case.
        # [Note: step count] ``state["step"]`` is a Python float, not torch's 0-dim tensor: adding 1
        # to 200 tensors costs ~0.5 ms a step. torch's Adam converts it on load_state_dict.
        buckets: dict[tuple[Any, ...], tuple[list[torch.Tensor], ...]] = {}
        for p in group["params"]:
            grad = p.grad
            if grad is None:
                continue
            if grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            state = self.state[p]
            if not state:
                state["step"] = 0.0
                state["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                state["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            elif state["exp_avg"].dtype != torch.float32 or torch.is_tensor(state["step"]):  # loaded from elsewhere
                state["step"] = float(state["step"])
                state["exp_avg"] = state["exp_avg"].float()
                state["exp_avg_sq"] = state["exp_avg_sq"].float()
            step = state["step"] = state["step"] + 1.0
            lists = buckets.setdefault((p.device, p.dtype, grad.dtype, int(step)), ([], [], [], []))
            lists[0].append(p)
            lists[1].append(grad if grad.is_contiguous() else grad.contiguous())
            lists[2].append(state["exp_avg"])
            lists[3].append(state["exp_avg_sq"])
        beta1, beta2 = group["betas"]
        for (device, dtype, _, step), (params, grads, exp_avgs, exp_avg_sqs) in buckets.items():
            options = dict(
                step=step,
                lr=group["lr"],
                beta1=beta1,
                beta2=beta2,
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                adamw_mode=group["adamw_mode"],
            )
            if device.type == "cuda":
                fused_adam_step(params, grads, exp_avgs, exp_avg_sqs, **options)
            elif dtype == torch.float32 and all(p.is_contiguous() for p in params):
                cpu_adam_step(params, grads, exp_avgs, exp_avg_sqs, num_threads=self.num_threads, **options)
            else:
                torch_adam_step(params, grads, exp_avgs, exp_avg_sqs, **options)


class CPUAdam(_Adam):
    """Adam/AdamW for parameters in CPU memory, on the SIMD kernel (or torch's fused Adam).

    ``num_threads`` defaults to ``torch.get_num_threads()`` at each step.
    """

    def __init__(self, params: Iterable[Any], *args: Any, **kwargs: Any) -> None:
        super().__init__(params, *args, **kwargs)
        for group in self.param_groups:
            for p in group["params"]:
                if p.device.type != "cpu":
                    raise ValueError(f"CPUAdam updates CPU tensors, got a parameter on {p.device}; use FusedAdam")
        cpu_adam_available()  # build or load now, not inside the first step


class FusedAdam(_Adam):
    """Adam/AdamW with one multi-tensor CUDA kernel per param group.

    Parameters in CPU memory take the CPU kernel instead, so a FusedAdam built on a machine
    without CUDA still trains (at CPU speed); without any compiled op it uses torch's fused Adam.
    """

    def __init__(self, params: Iterable[Any], *args: Any, **kwargs: Any) -> None:
        super().__init__(params, *args, **kwargs)
        devices = {p.device.type for group in self.param_groups for p in group["params"]}
        if "cuda" in devices:
            fused_adam_available()
        if "cpu" in devices:
            cpu_adam_available()
