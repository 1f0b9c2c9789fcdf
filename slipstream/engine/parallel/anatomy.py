"""What every parallelism needs to know about an unchanged model: where its repeated blocks are.

[Note: blocks] A transformer is a prologue (embeddings), a run of identical blocks and an epilogue
(final norm, head). The blocks are the children of the outermost ``ModuleList``/``Sequential``
with at least two parameterised children of one class: GPT-2's ``transformer.h``, Llama's
``model.layers``, a plain ``nn.Sequential`` of identical layers. Pipeline cutting gives stages
contiguous ranges of them; tensor parallel infers its plan within each. (ZeRO-3 finds its units
with the same rule in ``zero/stage3/units.py``: ``parallel`` and ``zero`` do not import each other.)
"""

from __future__ import annotations

import dataclasses

import torch

# A class attribute of the module a pipeline stage puts in place of a block another stage runs.
BLOCK_STAND_IN = "is_block_stand_in"


@dataclasses.dataclass(frozen=True)
class Blocks:
    """The repeated blocks of a model: the container's qualified name and its children in order."""

    container: str  # qualified name of the ModuleList/Sequential ("" for the model itself)
    names: tuple[str, ...]  # qualified names of the blocks
    modules: tuple[torch.nn.Module, ...]

    def __len__(self) -> int:
        return len(self.modules)


def find_blocks(model: torch.nn.Module) -> Blocks | None:
    """The longest run of same-class parameterised children of one ``ModuleList``/``Sequential`` (first found on a tie).

    A pipeline stage's container counts its cut-away blocks' stand-ins (``BLOCK_STAND_IN``) as slots: a stage
    that keeps one block of many still has blocks (the one it runs), where a container of one block does not.
    """
    best: Blocks | None = None
    for name, module in model.named_modules():
        if not isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
            continue
        children = [(n, c) for n, c in module.named_children() if any(True for _ in c.parameters())]
        slots = len(children) + sum(1 for c in module.children() if getattr(c, BLOCK_STAND_IN, False))
        if (
            children
            and slots >= 2
            and len({type(c) for _, c in children}) == 1
            and (best is None or len(children) > len(best))
        ):
            prefix = f"{name}." if name else ""
            best = Blocks(name, tuple(prefix + n for n, _ in children), tuple(c for _, c in children))
    return best
