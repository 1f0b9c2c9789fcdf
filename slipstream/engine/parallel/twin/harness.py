"""The twin harness: what every parallelism's twin check shares (see [Note: why a twin check] in ``__init__``).

The synthetic batch (``synthetic_tokens``, ``synthetic_batches``), the quiet run (``quiet_model``:
eval mode, forked RNG, gradients restored), the comparisons (``relative_difference``,
``loss_mismatch``, ``first_gradient_mismatch``, ``local_piece``), the one tolerance table
(``TOLERANCES``, ``tolerance_for``), and the verdict (``agree``: every rank of the group raises
together, naming the lowest rank's first finding). ``check_whole_model`` is the whole-model twin
built from them (tensor parallel's); the per-parallelism twins sit beside this module.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from slipstream import comm
from slipstream.engine.config import ConfigError
from slipstream.engine.parallel.calls import call_model, loss_of

# [Note: the tolerance table] One table for every twin: (fp32 or fp64, bf16 or fp16) per kind of
# comparison. "model": losses and gradients as relative norms; fp32 arithmetic in another order
# differs by ~1e-6 relative, a dropped keyword, a wrong mask or a skipped block by 1e-3 and more
# (measured on tiny random models, where such faults move the least). "block": one tensor-parallel
# block's outputs replayed on its recorded inputs, as the largest elementwise difference over the
# output's largest magnitude: no reduction order but the sharded matmul's own, so it is held tighter.
TOLERANCES = {"model": (1e-4, 2e-2), "block": (1e-5, 3e-2)}


def tolerance_for(model: torch.nn.Module, kind: str = "model") -> float:
    full, low = TOLERANCES[kind]
    first = next(model.parameters(), None)
    return full if first is None or first.dtype in (torch.float32, torch.float64) else low


@dataclasses.dataclass
class TwinMismatch:
    what: str  # "module 'model.layers.0.self_attn'", "the loss", "the gradient of 'lm_head.weight'"
    difference: float


def relative_difference(ours: torch.Tensor, reference: torch.Tensor, floor: float = 0.0) -> float:
    """‖ours − reference‖ / max(‖reference‖, floor): ``floor`` keeps a gradient that is zero in exact arithmetic
    (a key bias under softmax's shift invariance) from turning rounding noise into a large relative error."""
    ours, reference = ours.detach().float(), reference.detach().float()  # fp32 norms: ample for a 1e-4 verdict
    difference = torch.linalg.vector_norm(ours - reference).item()
    if difference != difference or difference == float("inf"):  # a non-finite value on our side
        return float("inf")
    return difference / max(torch.linalg.vector_norm(reference).item(), floor, 1e-12)


def gradient_floor(reference: dict[str, torch.Tensor]) -> float:
    """1e-3 of the whole model's reference gradient norm: the scale below which a parameter's gradient is noise."""
    return 1e-3 * float(sum(torch.linalg.vector_norm(g.float()).item() ** 2 for g in reference.values()) ** 0.5)


def first_gradient_mismatch(
    pairs: Iterable[tuple[str, torch.Tensor, torch.Tensor]], reference: dict[str, torch.Tensor], tolerance: float
) -> TwinMismatch | None:
    """The first ``(name, ours, theirs)`` whose gradients differ beyond ``tolerance`` (near-zero ones against the floor)."""
    floor = gradient_floor(reference)
    for name, ours, theirs in pairs:
        difference = relative_difference(ours, theirs, floor)
        if difference > tolerance:
            return TwinMismatch(f"the gradient of {name!r} (module {name.rpartition('.')[0]!r})", difference)
    return None


def loss_mismatch(ours: float, theirs: float, tolerance: float, what: str = "the loss") -> TwinMismatch | None:
    difference = abs(ours - theirs) / max(abs(theirs), 1e-12)
    return TwinMismatch(what, difference) if difference > tolerance else None


def local_piece(reference: torch.Tensor, param: torch.Tensor) -> torch.Tensor | None:
    """The part of a whole-model tensor this rank's (possibly sharded) parameter holds, by its placement."""
    from slipstream.utils.pieces import box_index
    from slipstream.utils.placement import placement_of

    placed = placement_of(param)
    if placed is None or tuple(placed.global_shape) != tuple(reference.shape):
        return reference if reference.shape == param.shape else None
    if placed.boxes is not None:
        return torch.cat([reference[box_index(box)].reshape(-1) for box in placed.boxes]).view(param.shape)
    box = placed.box(tuple(param.shape))
    return reference if box is None else reference[box_index(box)]


def _local_pairs(
    model: torch.nn.Module, reference: dict[str, torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """Each parameter's gradient beside the piece of the reference gradient it holds (sharded or whole)."""
    for name, p in model.named_parameters():
        piece = local_piece(reference[name], p) if name in reference else None
        if piece is not None:
            yield name, (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(piece.shape), piece


def whole_model_reference(model: torch.nn.Module, batch: Any) -> tuple[float, dict[str, torch.Tensor]]:
    """The unparallelized model's loss and gradients on ``batch`` (eval mode, forked RNG, no gradient left behind)."""
    with quiet_model(model):
        for p in model.parameters():
            p.grad = None
        loss = loss_of(call_model(model, batch))
        loss.backward()
        grads = {
            n: p.grad for n, p in model.named_parameters() if p.grad is not None
        }  # taken (quiet_model restores .grad)
    return float(loss.detach()), grads


def check_whole_model(
    model: torch.nn.Module,
    batch: Any,
    expected: tuple[float, dict[str, torch.Tensor]],
    group: dist.ProcessGroup,
    headline: str,
    against: str,
) -> None:
    """The parallelized model on ``batch`` against ``expected`` (its unparallelized twin): the loss, then every
    parameter's gradient on this rank's piece; all ranks of ``group`` raise together naming the first difference."""
    ref_loss, ref_grads = expected
    tolerance = tolerance_for(model)
    mismatch = None
    with quiet_model(model):
        for p in model.parameters():
            p.grad = None
        try:
            loss = loss_of(call_model(model, batch))
            loss.backward()
        except Exception as err:  # noqa: BLE001 - a parallelized model that cannot run is the finding
            mismatch = TwinMismatch(
                f"the parallelized model fails on its own ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})",
                float("inf"),
            )
        if mismatch is None:
            mismatch = loss_mismatch(float(loss.detach()), ref_loss, tolerance)
        if mismatch is None:
            mismatch = first_gradient_mismatch(_local_pairs(model, ref_grads), ref_grads, tolerance)
    agree(mismatch, group, headline, against)


def synthetic_tokens(model: torch.nn.Module, divisor: int, seed: int = 0, target: int = 32) -> torch.Tensor:
    """1 × L random token ids (the same on every rank): L a multiple of ``divisor``, inside the model's positions."""
    config = getattr(model, "config", None)
    vocab = int(getattr(config, "vocab_size", 0) or 256)
    limit = min(
        (
            int(v)
            for v in (getattr(config, k, None) for k in ("max_position_embeddings", "n_positions", "n_ctx"))
            if isinstance(v, int) and v > 0
        ),
        default=256,
    )
    length = max(divisor * max(1, target // divisor), divisor)
    if length > limit:
        length = max(divisor, limit // divisor * divisor)
    generator = torch.Generator().manual_seed(20261126 + seed)
    return torch.randint(0, vocab, (1, length), generator=generator)


def _vocabulary(model: torch.nn.Module) -> int | None:
    config = getattr(model, "config", None)
    if isinstance(getattr(config, "vocab_size", None), int):
        return int(config.vocab_size)
    first = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    return first.num_embeddings if first is not None else None


def synthetic_batches(model: torch.nn.Module, count: int, divisor: int = 8, target: int = 32) -> list[Any] | None:
    """``count`` synthetic micro-batches in the first call convention the model accepts that returns a loss:
    ``model(input_ids=, labels=)``, ``model(tokens, labels)``, ``model(tokens)``; None for a model that takes none."""
    vocab = _vocabulary(model)
    if vocab is None:
        return None
    device = next(model.parameters()).device
    tokens = [
        synthetic_tokens(model, divisor, seed=k, target=target).to(device).clamp_(max=vocab - 1) for k in range(count)
    ]
    conventions = (lambda t: {"input_ids": t, "labels": t.clone()}, lambda t: (t, t.clone()), lambda t: t)
    with quiet_model(model), torch.no_grad():
        for make in conventions:
            try:
                loss_of(call_model(model, make(tokens[0])))
            except Exception:  # noqa: BLE001 - probing the model's call convention
                continue
            return [make(t) for t in tokens]
    return None


@contextlib.contextmanager
def quiet_model(model: torch.nn.Module) -> Any:
    """Eval mode, a forked RNG, and the parameters' gradients restored afterwards."""
    was_training = model.training
    saved = {p: p.grad for p in model.parameters()}
    # The CPU generator is forked; eval mode draws nothing from a device's (no dropout runs).
    with torch.random.fork_rng(devices=[]):
        model.eval()
        try:
            yield
        finally:
            model.train(was_training)
            for p, g in saved.items():
                p.grad = g


def agree(
    mismatch: TwinMismatch | None,
    group: dist.ProcessGroup,
    headline: str,
    against: str = "the model's own attention on the whole sequence",
    message: Callable[[str, int], str] | None = None,
) -> None:
    """Every rank of the group raises if any rank saw a mismatch (the lowest such rank's finding).

    ``message(finding, rank)`` words the error when the default (``headline``: the finding against
    ``against``, and how to train anyway) does not fit."""
    flag = torch.tensor(
        [dist.get_rank(group) if mismatch is not None else dist.get_world_size(group)], dtype=torch.int64
    )
    comm.all_reduce(flag, op=dist.ReduceOp.MIN, group=group, tag="twin check verdict").wait()
    first = int(flag.item())
    if first == dist.get_world_size(group):
        return
    found = None
    if dist.get_rank(group) == first:
        found = mismatch.what + (
            f" differs by {mismatch.difference:.2e} (relative)" if mismatch.difference != float("inf") else ""
        )
    found = comm.broadcast_object(found, src=dist.get_global_rank(group, first), group=group)
    if message is not None:
        raise ConfigError(message(found, first))
    raise ConfigError(
        f"{headline}: {found} on rank {first} of the group, against {against}; the model uses something this mode "
        "does not implement. Train it without this mode, or set twin_check: false to train anyway at your own risk"
    )
