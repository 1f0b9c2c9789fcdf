"""Tiled MLP: each block's MLP run over token tiles, its ``tokens × intermediate`` activations never whole.

[Note: which modules are tiled] An MLP may be tiled only if each token's output depends on that
token alone. Found by default in each repeated block (``anatomy.find_blocks``): a direct child that
holds at least two linear-like leaves (a 2-D weight), no container of same-class children and no
parameter of more than two dimensions (experts: routing and capacity depend on the whole batch, and
an MoE's router outputs are recorded per call), and whose forward takes one required argument.
``long_context.tiled_mlp.module_classes`` names the classes instead. Either way each candidate is
then *probed* at ``initialize``: on random tokens (two rows), in eval mode, its output computed
whole must equal its output computed over tiles that cut across the rows; a module that mixes
tokens (GPT-2's attention also takes one argument) fails the probe and is left alone, or, when the
user named its class, refused. The tiles flatten the micro-batch's rows and positions, so any batch
size is tiled (DeepSpeed's TiledMLP assumes one row).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from slipstream.engine.config import ConfigError
from slipstream.engine.parallel.anatomy import find_blocks
from slipstream.engine.parallel.tiling.tiles import call_with, replace_forward, tiled
from slipstream.utils.eager_island import declare, island, register

_PROBE_ROWS, _PROBE_TOKENS, _PROBE_TILE = 2, 6, 4


def _linear_leaves(module: torch.nn.Module) -> int:
    return sum(
        1
        for m in module.modules()
        if not list(m.children())
        and isinstance(getattr(m, "weight", None), torch.Tensor)
        and m.weight.dim() == 2
        and not isinstance(m, torch.nn.Embedding)
    )


def _one_argument(module: torch.nn.Module) -> bool:
    try:
        params = inspect.signature(type(module).forward).parameters.values()
    except (TypeError, ValueError):
        return False
    required = [
        p
        for p in params
        if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return len(required) == 2  # self and the hidden states


def _repeats_modules(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds a list (or dict) of several modules of one class: experts, or a stack of layers."""
    return any(
        isinstance(m, (torch.nn.ModuleList, torch.nn.ModuleDict))
        and len({type(c) for c in m.children()}) == 1
        and len(m) > 1
        for m in module.modules()
    )


def _looks_like_mlp(module: torch.nn.Module) -> bool:
    return (
        _linear_leaves(module) >= 2
        and not _repeats_modules(module)
        and all(p.dim() <= 2 for p in module.parameters())
        and _one_argument(module)
    )


def candidates(model: torch.nn.Module, classes: Sequence[str] | None) -> list[tuple[str, torch.nn.Module]]:
    """The modules to tile, before the probe: of ``classes`` anywhere, else the MLP-shaped children of each block."""
    if classes:
        return [(n, m) for n, m in model.named_modules() if type(m).__name__ in classes]
    blocks = find_blocks(model)
    if blocks is None:
        return []
    return [
        (f"{block_name}.{child_name}", child)
        for block_name, block in zip(blocks.names, blocks.modules)
        for child_name, child in block.named_children()
        if _looks_like_mlp(child)
    ]


def _experts(model: torch.nn.Module) -> str | None:
    """The class of the first block child that holds experts (several modules of one class, or weights stacked
    over experts in one 3-D parameter), or None."""
    blocks = find_blocks(model)
    for block in blocks.modules if blocks is not None else ():
        for child in block.children():
            stacked = any(p.dim() == 3 for p in child.parameters())
            if stacked or (_repeats_modules(child) and _linear_leaves(child) >= 2):
                return type(child).__name__
    return None


def _hidden_size(model: torch.nn.Module, module: torch.nn.Module) -> int | None:
    size = getattr(getattr(model, "config", None), "hidden_size", None)
    if isinstance(size, int):
        return size
    first = next((m for m in module.modules() if isinstance(m, torch.nn.Linear)), None)
    return first.in_features if first is not None else None


def token_wise(module: torch.nn.Module, hidden: int | None) -> bool:
    """Whether ``module`` computes each token from that token alone: whole equals tiled on random tokens (eval mode);
    False when its input width (``hidden``) is unknown."""
    if hidden is None:
        return False
    param = next(module.parameters())
    # the same tokens on every rank: a tensor-parallel MLP's collectives see consistent shapes and values
    x = torch.randn(_PROBE_ROWS, _PROBE_TOKENS, hidden, generator=torch.Generator().manual_seed(0)).to(
        param.device, param.dtype
    )
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        with torch.no_grad():
            whole = module(x)
            flat = x.reshape(-1, hidden)
            pieces = [module(flat[s : s + _PROBE_TILE].unsqueeze(0)) for s in range(0, flat.shape[0], _PROBE_TILE)]
            if not isinstance(whole, torch.Tensor) or not all(isinstance(p, torch.Tensor) for p in pieces):
                return False
            tiles = torch.cat([p.squeeze(0) for p in pieces], 0).reshape(whole.shape)
    except (RuntimeError, TypeError, ValueError):
        return False
    finally:
        for m, mode in modes:
            m.training = mode
    scale = whole.abs().max().clamp_min(1e-6)
    return bool(((whole - tiles).abs().max() / scale) < 1e-4)


class TiledMLP:
    """``modules``' forwards run over token tiles of ``tile_tokens`` (``tiles.py``); shorter inputs run as they are."""

    def __init__(self, modules: Sequence[tuple[str, torch.nn.Module]], tile_tokens: int) -> None:
        self.tile = tile_tokens
        self.names = [name for name, _ in modules]
        self._undo = [replace_forward(module, self._tiling(module, module.forward)) for _, module in modules]

    def _tiling(self, module: torch.nn.Module, forward: Callable[..., Any]) -> Callable[..., Any]:
        names = [n for n, _ in module.named_parameters()]

        def run(start: int, piece: torch.Tensor, weights: Sequence[torch.Tensor]) -> torch.Tensor:
            return call_with(module, forward, names, weights, piece.unsqueeze(0)).squeeze(0)

        def over_tiles(x: torch.Tensor) -> torch.Tensor:
            params = [p for _, p in module.named_parameters()]  # read per call: whatever holds them now
            out = tiled(run, x.reshape(-1, x.shape[-1]), params, self.tile, "cat")
            return out.reshape(*x.shape[:-1], out.shape[-1])

        register(over_tiles)  # one eager island inside a compiled block (utils/eager_island.py)

        def tiling_forward(*args: Any, **kwargs: Any) -> Any:
            x = args[0] if len(args) == 1 and not kwargs else None
            if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[:-1].numel() <= self.tile:
                return forward(*args, **kwargs)
            return island(_over_tiles, (x,), (over_tiles,))

        return tiling_forward

    def close(self) -> None:
        """Each module's own forward back."""
        for undo in self._undo:
            undo()


def _over_tiles(x: torch.Tensor, over_tiles: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    return over_tiles(x)


# An MLP's output joins the residual stream, so it has its input's shape.
declare(_over_tiles, lambda x, _: torch.empty_like(x))


def tile_mlps(model: torch.nn.Module, classes: Sequence[str] | None, tile_tokens: int, probe: bool) -> TiledMLP:
    """The model's MLPs tiled ([Note: which modules are tiled]); :class:`ConfigError` naming the key when none is, or
    when a named class mixes tokens. ``probe`` False (weights not materialised here): named classes only, unprobed."""
    found = candidates(model, classes)
    kept = []
    for name, module in found:
        if probe and not token_wise(module, _hidden_size(model, module)):
            if classes:
                raise ConfigError(
                    f"long_context.tiled_mlp.module_classes: {type(module).__name__} ({name}) does not compute each token from "
                    "that token alone (its output over token tiles differs from its output on the whole sequence); it cannot be tiled"
                )
            continue
        kept.append((name, module))
    if not kept:
        experts = None if classes else _experts(model)
        if experts is not None:
            raise ConfigError(
                f"long_context.tiled_mlp: the blocks' feed-forward layers are mixtures of experts ({experts}), which are "
                "never tiled (routing and capacity depend on the whole batch); turn long_context.tiled_mlp off"
            )
        raise ConfigError(
            "long_context.tiled_mlp: found no MLP to tile in the model's blocks (a child with two linear layers computing "
            "each token alone); name the class in long_context.tiled_mlp.module_classes"
        )
    return TiledMLP(kept, tile_tokens)
