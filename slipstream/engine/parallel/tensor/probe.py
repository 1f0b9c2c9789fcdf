"""The probe run: one fixed tiny batch through the unsharded model, recording what tensor parallel needs.

Before cutting, the model runs once (a Hugging Face model through its own forward, otherwise a
fixed random input through each block) with every block's inputs and outputs recorded
(``capture``): the tensor-parallel twin replays them on the sharded blocks
(``twin/tensor_blocks.py``), the plan inference reads the leaves' inputs (``leaf_inputs``), and
sequence parallel learns which modules call the attention function (``attention_modules``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from slipstream.engine.config import ConfigError
from slipstream.engine.parallel.attention import recording_attention_callers
from slipstream.engine.parallel.calls import call_model
from slipstream.engine.parallel.tensor.plan import in_features
from slipstream.engine.parallel.twin.harness import synthetic_batches
from slipstream.engine.parallel.twin.tensor_blocks import tensors_of


@dataclasses.dataclass
class Probe:
    """Each block's recorded call (args, kwargs) and output, and the leaves in execution order."""

    calls: list[tuple[tuple[Any, ...], dict[str, Any]]]
    outputs: list[Any]
    order: list[str]


def _detach(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_detach(v) for v in value)
    if isinstance(value, dict):
        return {k: _detach(v) for k, v in value.items()}
    return value


def _run_model(model: torch.nn.Module, blocks: Sequence[torch.nn.Module], leaves: dict[str, torch.nn.Module]) -> None:
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    device = next(model.parameters()).device
    if isinstance(vocab, int) and vocab > 0:
        ids = (torch.arange(16, device=device) * 7 + 3).remainder(vocab).view(2, 8)
        calls = ({"input_ids": ids, "use_cache": False}, {"input_ids": ids}, {"input_ids": ids, "labels": ids})
        for k, kwargs in enumerate(calls):  # the last one for encoder-decoders, which need decoder inputs (or labels)
            try:
                model(**kwargs)
                return
            except (TypeError, ValueError):
                if k == len(calls) - 1:
                    raise
        return
    # A custom model that takes token ids runs its own forward, so each block is recorded with the keywords the
    # model passes it (a block may need more than its hidden state); a block it never calls is not checked.
    batches = synthetic_batches(model, 1, target=8)
    if batches is not None:
        call_model(model, batches[0])
        return
    first = next(iter(leaves.values()))
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, in_features(first), generator=generator).to(device=device, dtype=first.weight.dtype)
    for block in blocks:
        try:
            out = block(x)
        except TypeError as err:
            raise ConfigError(
                f"tensor_parallel: the self-check cannot call a block of {type(model).__name__} on its own ({err}), and the "
                "model takes no token batch to run it with; tensor parallel cannot be checked on it"
            ) from None
        x = out if isinstance(out, torch.Tensor) else tensors_of(out)[0]


def capture(model: torch.nn.Module, blocks: Sequence[torch.nn.Module], leaves: dict[str, torch.nn.Module]) -> Probe:
    """Run the probe batch through the unsharded model, recording what :func:`verify` replays."""
    probe = Probe([None] * len(blocks), [None] * len(blocks), [])  # type: ignore[list-item]
    handles = []
    for name, leaf in leaves.items():
        handles.append(
            leaf.register_forward_hook(
                lambda m, a, o, name=name: probe.order.append(name) if name not in probe.order else None
            )
        )
    for i, block in enumerate(blocks):

        def record(module: torch.nn.Module, args: Any, kwargs: Any, output: Any, i: int = i) -> None:
            if probe.calls[i] is None:
                probe.calls[i] = (_detach(args), _detach(kwargs))
                probe.outputs[i] = _detach(output)

        handles.append(block.register_forward_hook(record, with_kwargs=True))
    _probe_run(model, blocks, leaves, handles, torch.no_grad())
    return probe


def _probe_run(
    model: torch.nn.Module,
    blocks: Sequence[torch.nn.Module],
    leaves: dict[str, torch.nn.Module],
    handles: Sequence[Any],
    context: contextlib.AbstractContextManager[Any],
) -> None:
    """The probe batch through the model in eval mode inside ``context``; the hooks removed and each module's mode
    restored afterwards, even on an error."""
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        with context:
            _run_model(model, blocks, leaves)
    finally:
        for handle in handles:
            handle.remove()
        for module, mode in modes.items():
            module.training = mode


def leaf_inputs(
    model: torch.nn.Module, blocks: Sequence[torch.nn.Module], leaves: dict[str, torch.nn.Module]
) -> dict[str, set[str]]:
    """For each leaf, the leaves of its block whose outputs its input is computed from (plan.py's [Note: inference]):
    one forward with gradients on the probe batch, each leaf's input traced back through the autograd graph to
    the outputs of earlier leaves, stopping at them and at the block's own input."""
    produced: dict[Any, str] = {}  # a leaf output's grad_fn -> the leaf
    stops: set[Any] = set()  # the blocks' inputs
    found: dict[str, set[str]] = {}

    def enter_block(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        hidden = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("hidden_states")
        if isinstance(hidden, torch.Tensor) and hidden.grad_fn is not None:
            stops.add(hidden.grad_fn)

    def leaf_hook(name: str) -> Any:
        def hook(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if name not in found and args and isinstance(args[0], torch.Tensor):
                found[name] = _reached(args[0].grad_fn, produced, stops)
            if isinstance(output, torch.Tensor) and output.grad_fn is not None:
                produced[output.grad_fn] = name

        return hook

    handles = [b.register_forward_pre_hook(enter_block, with_kwargs=True) for b in blocks]
    handles += [leaf.register_forward_hook(leaf_hook(name)) for name, leaf in leaves.items()]
    _probe_run(model, blocks, leaves, handles, torch.enable_grad())
    return found


def _reached(node: Any, produced: dict[Any, str], stops: set[Any], budget: int = 20000) -> set[str]:
    """The leaves whose outputs ``node`` (an autograd node) is computed from, not looking past them or ``stops``."""
    reached: set[str] = set()
    seen: set[Any] = set()
    frontier = [node] if node is not None else []
    while frontier and len(seen) < budget:
        current = frontier.pop()
        if current is None or current in seen:
            continue
        seen.add(current)
        if current in produced:
            reached.add(produced[current])
            continue
        if current in stops:
            continue
        frontier.extend(next_node for next_node, _ in current.next_functions)
    return reached


def attention_modules(
    model: torch.nn.Module, blocks: Sequence[torch.nn.Module], leaves: dict[str, torch.nn.Module]
) -> list[torch.nn.Module]:
    """The modules that call transformers' attention function on the probe batch (parallel/attention.py's recorder)."""
    with recording_attention_callers(model) as found:
        _probe_run(model, blocks, leaves, (), torch.no_grad())
    return found
