"""Sequence parallelism for a model no attention kernel reaches: its blocks run on sequence shards, the rest whole.

[Note: blockwise sequence parallel] Ulysses and ring attention need the model to attend through transformers'
attention interface and to take its labels shifted by the engine (sequence/inputs.py). A model that does
neither (its own attention code, ALiBi added inline, an encoder-decoder, a custom model computing its own loss
from ``labels``) would be refused. Here every rank of the sequence group runs the model's own forward on the
whole micro-batch, so embeddings, positions, masks, the head and the loss are one process's; only the repeated
blocks run on this rank's contiguous ``1/u`` of the sequence:

* at a block's entry the whole hidden state is cut (``split``; backward: all-gather), with every other tensor
  argument laid out ``[batch, sequence, ...]`` over the whole sequence (a value-residual input, a per-position
  gate, rotary tables); between blocks the hidden state stays cut;
* the modules inside a block that mix positions (found once on the unchanged model: perturbing the first
  token changes their output at later tokens while their input there is unchanged: attention, whatever its
  code) run on the whole sequence, gathered at their entry (backward: reduce-scatter) and cut back at their
  exit keeping this rank's chunk (backward: that chunk's gradient in place, zeros elsewhere), as tensor
  parallel's replicated attention does (tensor/sequence.py);
* the last block that runs gathers its output (backward: this rank's chunk of a gradient every rank computes
  alike), so the head and the loss see the whole sequence.

Gradients: the parameters outside the blocks see whole tensors and hold the whole gradient on every rank; a
block's parameters hold this rank's share. ZeRO averages over the group, so the shares are scaled by ``u``
first (a hook on each block parameter, only in the engine's steps): the mean of ``u`` shares is their sum.

What it divides: the blocks' activations outside attention (MLPs, norms, residuals). What it does not: the
attention of each block (whole on every rank, computed ``u`` times), the embeddings, the logits and the loss.
The twin check compares it with the whole model, as for the kernels, and refuses what it gets wrong.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from slipstream.engine.parallel.anatomy import Blocks
from slipstream.engine.parallel.calls import call_model
from slipstream.engine.parallel.context.token_layout import Layout
from slipstream.engine.parallel.tensor import ops

SEQ_DIM = 1  # batch-first activations


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``fn`` applied to every tensor in ``value`` (a tensor, or tuples/lists of them, one level deep per call)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value):
        return type(value)(_map_tensors(v, fn) for v in value)
    return value


def _first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    for value in (*args, kwargs.get("hidden_states"), *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() >= 3:
            return value
    return None


def _first_output(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


def position_mixers(model: torch.nn.Module, blocks: Blocks, batch: Any) -> tuple[list[str], list[int]]:
    """The modules of the first block that runs that mix positions (relative names; "" for the block itself), the
    innermost ones; and the indices of the blocks one forward calls, in call order. See the module note."""
    recorded: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    calls: list[int] = []

    def record(index: int) -> Any:
        def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            calls.append(index)
            if not recorded:  # the first block that runs (a forward may skip the first)
                recorded.append((args, kwargs))

        return hook

    handles = [m.register_forward_pre_hook(record(i), with_kwargs=True) for i, m in enumerate(blocks.modules)]
    uses_cache = isinstance(batch, dict) and hasattr(getattr(model, "config", None), "use_cache")
    try:
        with torch.no_grad():  # no key/value cache: the first block runs twice more on the call recorded here
            call_model(model, {**batch, "use_cache": False} if uses_cache else batch)
    finally:
        for handle in handles:
            handle.remove()
    if not recorded:
        return [], calls
    args, kwargs = recorded[0]
    first = blocks.modules[calls[0]]
    hidden = _first_tensor(args, kwargs)
    if hidden is None or hidden.shape[SEQ_DIM] < 2:
        return [""], calls

    def run(perturb: bool) -> dict[str, tuple[torch.Tensor | None, torch.Tensor | None]]:
        seen: dict[str, tuple[torch.Tensor | None, torch.Tensor | None]] = {}

        def hook(name: str) -> Any:
            def record_io(module: torch.nn.Module, a: tuple[Any, ...], k: dict[str, Any], output: Any) -> None:
                if name not in seen:  # copies: the forward may change them in place later (Falcon's ``+=``)
                    given, out = _first_tensor(a, k), _first_output(output)
                    seen[name] = (
                        given.clone() if given is not None else None,
                        out.clone() if out is not None else None,
                    )

            return record_io

        moved = hidden.clone()
        if perturb:
            moved[:, 0] += 1.0
        call_args, call_kwargs = (args, kwargs)
        if args and args[0] is hidden:
            call_args = (moved, *args[1:])
        else:
            key = next(k for k, v in kwargs.items() if v is hidden)
            call_kwargs = {**kwargs, key: moved}
        hooks = [m.register_forward_hook(hook(n), with_kwargs=True) for n, m in first.named_modules()]
        try:
            with torch.no_grad():
                first(*call_args, **call_kwargs)
        finally:
            for handle in hooks:
                handle.remove()
        return seen

    base, moved = run(False), run(True)
    mixers = []
    for name, (given, out) in base.items():
        given2, out2 = moved.get(name, (None, None))
        if out is None or out2 is None or out.dim() < 2 or out.shape != out2.shape or out.shape[SEQ_DIM] < 2:
            continue
        same_input = (
            given is not None
            and given2 is not None
            and given.shape == given2.shape
            and torch.equal(given[:, 1:], given2[:, 1:])
        )
        if same_input and not torch.equal(out[:, 1:], out2[:, 1:]):
            mixers.append(name)
    innermost = [n for n in mixers if not any(m != n and (n == "" or m.startswith(n + ".")) for m in mixers)]
    return innermost, calls


class BlockwiseSharder:
    """The engine's sharder for blockwise sequence parallelism (the module note): the same calls as
    ``SequenceSharder``; the batch is not cut, the blocks' hooks cut and gather inside the engine's steps."""

    def __init__(
        self,
        model: torch.nn.Module,
        blocks: Blocks,
        group: dist.ProcessGroup,
        key: str,
        mixers: list[str],
        calls: list[int],
    ) -> None:
        self.group, self.key = group, key
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.layout = Layout(self.size, zigzag=False)
        self.divisor = 1  # any length: a block's cut extends it (ops.split_sequence), the gather cuts it back
        self.active = False
        self.current = None
        self.first_batch: Callable[[dict[str, Any]], None] | None = None
        self._open = False  # a run of blocks is open: the hidden state between blocks is cut
        # the step's whole sequence until its backward is done: a block recomputed in backward (activation
        # checkpointing runs its forward again, without the block's hooks) still gathers around its attention
        self._whole: int | None = None
        # the step's block inputs left whole (weakly, by id: ids of freed tensors are reused): a mixer never gathers those
        self._uncut: dict[int, weakref.ref[torch.Tensor]] = {}
        last = calls[-1] if calls else len(blocks.modules) - 1
        self._handles = []
        for index, block in enumerate(blocks.modules):
            self._handles.append(block.register_forward_pre_hook(self._enter_block, with_kwargs=True))
            held = dict(block.named_modules())
            for name in mixers:
                if name in held:
                    self._handles += [
                        held[name].register_forward_pre_hook(self._enter_mixer, with_kwargs=True),
                        held[name].register_forward_hook(self._leave_mixer),
                    ]
            if index == last:
                self._handles.append(block.register_forward_hook(self._leave_blocks))
        seen: set[int] = set()
        for block in blocks.modules:
            for param in block.parameters():
                if param.requires_grad and id(param) not in seen:
                    seen.add(id(param))
                    self._handles.append(param.register_hook(self._share))

    # --- the engine's side (runners/direct.py, parallel/twin/whole_sequence.py)
    def shard(self, kwargs: dict[str, Any]) -> tuple[dict[str, Any], None]:
        return dict(kwargs), None  # every rank of the group runs the whole micro-batch

    def combine(self, output: Any, count: Any) -> Any:
        return output  # the model's own loss, on the whole sequence

    def activate(self) -> None:
        self.active = True

    def deactivate(self) -> None:
        self.active = self._open = False
        self._whole = None
        self._uncut = {}

    def resume(self, step: Any) -> None:
        self.active = True

    def positions(self, length: int) -> torch.Tensor:
        """This rank's tokens inside the blocks: a contiguous chunk (extended to a multiple of the group)."""
        return self.layout.positions(self.rank, -(-length // self.size) * self.size)

    def take_first_batch_check(self) -> Callable[[dict[str, Any]], None] | None:
        check, self.first_batch = self.first_batch, None
        return check

    def close(self) -> None:
        self.deactivate()
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # --- the hooks
    def _share(self, grad: torch.Tensor) -> torch.Tensor:
        return grad * self.size if self.active else grad

    def _cut_whole(self, value: Any, hidden: torch.Tensor | None) -> Any:
        length = self._whole

        def cut(t: torch.Tensor) -> torch.Tensor:
            if t.dim() >= 3 and t.shape[SEQ_DIM] == length:
                return ops.split_sequence(t, SEQ_DIM, self.group)
            if t is not hidden:  # e.g. a [b, heads, s, s] bias whose heads happen to equal the local length
                self._uncut[id(t)] = weakref.ref(t)
            return t

        return _map_tensors(value, cut)

    def _enter_block(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not self.active:
            return None
        hidden = _first_tensor(args, kwargs)
        if not self._open:  # a run of blocks opens: its hidden state is the whole sequence
            if hidden is None:
                return None
            self._open, self._whole = True, int(hidden.shape[SEQ_DIM])
        return tuple(self._cut_whole(a, hidden) for a in args), {
            k: self._cut_whole(v, hidden) for k, v in kwargs.items()
        }

    def _left_whole(self, t: torch.Tensor) -> bool:
        ref = self._uncut.get(id(t))
        return ref is not None and ref() is t

    def _enter_mixer(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not self.active or self._whole is None:
            return None
        length, local = self._whole, -(-self._whole // self.size)

        def gather(t: torch.Tensor) -> torch.Tensor:
            if t.dim() >= 3 and t.shape[SEQ_DIM] == local and local != length and not self._left_whole(t):
                return ops.gather_sequence(t, SEQ_DIM, self.group, "blockwise sp gather (mixer)", length=length)
            return t

        return tuple(_map_tensors(a, gather) for a in args), {k: _map_tensors(v, gather) for k, v in kwargs.items()}

    def _leave_mixer(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        if not self.active or self._whole is None:
            return None
        length = self._whole
        return _map_tensors(
            output,
            lambda t: ops.keep_chunk(t, SEQ_DIM, self.group) if t.dim() >= 3 and t.shape[SEQ_DIM] == length else t,
        )

    def _leave_blocks(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        if not self.active or not self._open or self._whole is None:
            return None
        length, local = self._whole, -(-self._whole // self.size)
        self._open = False
        if local == length:
            return None
        return _map_tensors(
            output,
            lambda t: (
                ops.gather_keep(t, SEQ_DIM, self.group, "blockwise sp gather (blocks' end)", length)
                if t.dim() >= 3 and t.shape[SEQ_DIM] == local
                else t
            ),
        )
