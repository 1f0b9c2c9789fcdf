"""The numerical twin check: before training, the parallelized model is run on a synthetic batch
next to its unparallelized twin, and a mismatch refuses to train naming the first module that diverges.

[Note: why a twin check] Rules catch the model features we thought of (a keyword, a non-causal
model, a cut that skips a block); the twin check catches the ones nobody wrote a rule for. For
sequence and context parallelism the twin is the same model with its own attention on the whole
sequence: every rank of the group holds the whole model, so each runs the reference itself, then
the engine's sharded forward and backward, and compares (a) every module's output on its own
tokens, in call order, (b) the whole-sequence loss, (c) the group-mean gradients. A kernel that
refuses a feature raises on the first forward: the same check turns that into the refusal at
``initialize``. The check runs in eval mode (dropout off, so both runs are deterministic) on a
1 × L batch of random tokens under a forked RNG, and leaves no gradient and no RNG change behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from slipstream import comm
from slipstream.engine.config import ConfigError
from slipstream.engine.parallel.attention import UnsupportedAttention
from slipstream.engine.parallel.calls import call_model, loss_of

# fp32 arithmetic in another order differs by ~1e-6 relative; a dropped keyword, a wrong mask or a
# skipped block by 1e-3 and more (measured on tiny random models, where such faults move the least).
FP32_TOLERANCE, LOW_PRECISION_TOLERANCE = 1e-4, 2e-2


def tolerance_for(model: torch.nn.Module) -> float:
    first = next(model.parameters(), None)
    return FP32_TOLERANCE if first is None or first.dtype in (torch.float32, torch.float64) else LOW_PRECISION_TOLERANCE


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


class _Recorder:
    """Each module's first tensor output, in call order (forward hooks on every module)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.outputs: list[tuple[str, torch.Tensor]] = []
        self.handles = [m.register_forward_hook(self._hook(name)) for name, m in model.named_modules() if name]

    def _hook(self, name: str) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            tensor = (
                output[0]
                if isinstance(output, (tuple, list)) and output
                else getattr(output, "last_hidden_state", output)
            )
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and tensor.dim() >= 2:
                self.outputs.append((name, tensor.detach().clone()))

        return hook

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


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


def check_sequence_twin(
    model: torch.nn.Module,
    sharder: Any,
    mode: str,
    averaging: Mapping[int, dist.ProcessGroup] | None = None,
    batch: dict[str, Any] | None = None,
    what: str = "a synthetic batch",
) -> None:
    """Sharded forward/backward vs. the same model's own attention on the whole sequence; raises ConfigError naming
    the first divergence. ``batch``: keyword arguments with labels (default: random tokens, ``what`` names it)."""
    if batch is None:
        tokens = synthetic_tokens(model, sharder.divisor).to(next(model.parameters()).device)
        batch = {"input_ids": tokens, "labels": tokens.clone()}
    source = batch.get("input_ids", batch.get("inputs_embeds"))
    length = int(source.shape[1])
    name = type(model).__name__
    tolerance = tolerance_for(model)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    with quiet_model(model), torch.enable_grad():
        recorder = _Recorder(model)
        try:
            reference = model(**batch)
            ref_loss = getattr(reference, "loss", None)
            if ref_loss is None:
                raise ConfigError(
                    f"{sharder.key}: {name} returned no loss for input_ids with labels; sequence sharding needs a model that computes its loss"
                )
            ref_grads = _gradients(ref_loss, trainable)
            ref_outputs, recorder.outputs = recorder.outputs, []
            local, count = sharder.shard(batch)
            sharder.activate()
            try:
                output = sharder.combine(model(**local), count)
                our_grads = _gradients(output.loss * 1.0, trainable)
            except UnsupportedAttention as err:
                raise ConfigError(str(err)) from None
            finally:
                sharder.deactivate()
            ours = recorder.outputs
        finally:
            recorder.close()
        gradients = first_gradient_mismatch(
            _group_mean_pairs(model, ref_grads, sharder.group, averaging, our_grads), ref_grads, tolerance
        )
        mismatch = (
            _first_mismatch(ref_outputs, ours, sharder, length, tolerance)
            or loss_mismatch(float(output.loss.detach()), float(ref_loss.detach()), tolerance)
            or gradients
        )
        agree(mismatch, sharder.group, f"{sharder.key}: {mode} does not reproduce {name} on {what} (twin check)")


def _gradients(loss: torch.Tensor, trainable: list[tuple[str, torch.nn.Parameter]]) -> dict[str, torch.Tensor]:
    """The loss's gradients by name, returned rather than accumulated: after ``initialize`` the ZeRO strategy's
    hooks take every gradient that reaches ``.grad`` (the first-batch check runs then), and must see none here."""
    found = torch.autograd.grad(loss, [p for _, p in trainable], allow_unused=True)
    return {n: g for (n, _), g in zip(trainable, found) if g is not None}


def check_sequence_pipeline_twin(
    pipeline: Any,
    sharder: Any,
    mode: str,
    averaging: Mapping[int, dist.ProcessGroup] | None = None,
    batch: dict[str, Any] | None = None,
    what: str = "a synthetic batch",
) -> None:
    """Under a pipeline: one schedule on whole sequences with the model's own attention against one on this
    rank's shards with the sharded attention; the loss, then this stage's group-mean gradients. Every rank
    of the world raises together (the stages' verdicts differ, and none may go on while another stops).
    ``batch``: keyword arguments with labels, run as every micro-batch of the schedule (default: random tokens)."""
    model = pipeline.model
    name, tolerance = type(model).__name__, tolerance_for(model)
    device = next(model.parameters()).device
    if batch is None:
        tokens = [synthetic_tokens(model, sharder.divisor, seed=k).to(device) for k in range(pipeline.micro_batches)]
        batches = [{"input_ids": t, "labels": t.clone()} for t in tokens]
    else:
        batches = [dict(batch) for _ in range(pipeline.micro_batches)]
    scale = 1.0 / len(batches)
    with quiet_model(model):
        for p in model.parameters():
            p.grad = None
        reference = pipeline.train_step(batches, scale, contextlib.nullcontext)
        ref_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}  # taken, not copied
        for p in model.parameters():
            p.grad = None
        local = [sharder.shard(b) for b in batches]
        sharder.activate()
        try:
            ours = pipeline.train_step(
                [b for b, _ in local], scale, contextlib.nullcontext, lambda out, i: sharder.combine(out, local[i][1])
            )
        finally:
            sharder.deactivate()
        gradients = first_gradient_mismatch(
            _group_mean_pairs(model, ref_grads, sharder.group, averaging), ref_grads, tolerance
        )
        mismatch = (
            loss_mismatch(
                sum(ours.losses) / len(ours.losses),
                sum(reference.losses) / len(reference.losses),
                tolerance,
                "the step's loss",
            )
            or gradients
        )
        pipeline.last_report = None
    agree(
        mismatch,
        dist.group.WORLD,
        f"{sharder.key}: {mode} inside the pipeline's stages does not reproduce {name} on {what} (twin check)",
        "the same pipeline with the model's own attention on whole sequences",
    )


def _first_mismatch(
    reference: list[tuple[str, torch.Tensor]],
    ours: list[tuple[str, torch.Tensor]],
    sharder: Any,
    length: int,
    tolerance: float,
) -> TwinMismatch | None:
    """The first module (in call order) whose output on this rank's tokens differs from the reference's (the
    engine's fill beyond ``length``, sequence/inputs.py, left out)."""
    index = sharder.positions(-(-length // sharder.divisor) * sharder.divisor)
    real = index < length
    ref_by_call = {}
    for name, tensor in reference:
        ref_by_call.setdefault(name, []).append(tensor)
    seen: dict[str, int] = {}
    for name, tensor in ours:
        k = seen.get(name, 0)
        seen[name] = k + 1
        candidates = ref_by_call.get(name, [])
        if k >= len(candidates):
            return TwinMismatch(f"module {name!r} (called more often than in the unparallelized model)", float("inf"))
        ref = candidates[k]
        if ref.dim() < 2 or ref.shape[1] != length or tensor.shape[1] != index.numel():
            continue  # not a per-token output (or not on the sequence dimension)
        ref_local = ref.index_select(1, index[real].to(ref.device))
        tensor = tensor[:, real.to(tensor.device)]
        if ref_local.shape != tensor.shape:
            continue
        difference = relative_difference(tensor, ref_local)
        if difference > tolerance:
            return TwinMismatch(f"module {name!r} ({type(tensor).__name__} output)", difference)
    return None


def _group_mean_pairs(
    model: torch.nn.Module,
    reference: dict[str, torch.Tensor],
    group: dist.ProcessGroup,
    averaging: Mapping[int, dist.ProcessGroup] | None = None,
    grads: dict[str, torch.Tensor] | None = None,
) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """The group-mean gradients (one flat all-reduce per group) beside the reference's, parameter by parameter.
    Collective: every rank of ``group`` computes them, whatever it found before (a rank whose module outputs
    already differ still takes part, or its peers' all-reduce meets the verdict's and gloo aborts).

    [Note: which ranks to average] The ranks of ``group`` hold the same parameters and saw different parts of
    the batch, so their mean is the whole batch's gradient. A parameter in ``averaging`` (an expert, by ``id``)
    is another one on each rank of ``group``; its own group (the ranks that hold the same experts, as ZeRO
    averages it) takes its place.
    """
    named = [(n, p) for n, p in model.named_parameters() if n in reference]
    by_group: dict[int, tuple[dist.ProcessGroup, list[tuple[str, torch.nn.Parameter]]]] = {}
    for name, p in named:
        own = (averaging or {}).get(id(p), group)
        by_group.setdefault(id(own), (own, []))[1].append((name, p))
    means: dict[str, torch.Tensor] = {}
    for own, members in by_group.values():  # the same groups in the same order on every rank: one model, one walk
        held = [
            (grads.get(name) if grads is not None else p.grad) for name, p in members
        ]  # ``grads``: by name, else .grad
        flat = torch.cat(
            [
                (g if g is not None else torch.zeros_like(reference[name])).detach().reshape(-1).float()
                for (name, _), g in zip(members, held)
            ]
        )
        comm.all_reduce(flat, group=own, tag="twin check gradients").wait()
        flat /= dist.get_world_size(own)
        offset = 0
        for name, _ in members:
            shape = reference[name].shape
            means[name] = flat[offset : offset + reference[name].numel()].view(shape)
            offset += reference[name].numel()
    for name, _ in named:
        yield name, means[name], reference[name]


def agree(
    mismatch: TwinMismatch | None,
    group: dist.ProcessGroup,
    headline: str,
    against: str = "the model's own attention on the whole sequence",
) -> None:
    """Every rank of the group raises if any rank saw a mismatch (the lowest such rank's finding)."""
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
    raise ConfigError(
        f"{headline}: {found} on rank {first} of the group, against {against}; the model uses something this mode "
        "does not implement. Train it without this mode, or set twin_check: false to train anyway at your own risk"
    )
