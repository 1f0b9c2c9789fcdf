"""Which parameters ZeRO-3 gathers together: the model cut into units.

[Note: units] A unit is a submodule whose parameters live in one flat, partitioned buffer and are
gathered with one collective before its forward and backward. By default the units are the
repeated children of every ``ModuleList``/``Sequential`` (a transformer's layers); the user may
name unit classes instead (``stage3_unit_modules``). Everything else belongs to the *root* unit,
gathered for the whole forward and backward. Two kinds of parameters are placed elsewhere:

* a parameter owned by modules of different units (tied weights such as GPT-2's ``wte`` and
  ``lm_head``), or registered as used outside its module (:func:`register_external_parameter`),
  goes to the root unit, the only one live wherever it might be used;
* a parameter smaller than ``stage3_param_persistence_threshold`` elements goes to the
  *persistent* unit, which stays gathered (it is updated by an all-gather after each step, like
  ZeRO-2) and so costs no collective per forward.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Literal

import torch

from slipstream.engine.config.base import ConfigError

UnitKind = Literal["root", "block", "persistent"]

# module -> parameters it uses in its forward although another module owns them
_external: weakref.WeakKeyDictionary[torch.nn.Module, list[torch.nn.Parameter]] = weakref.WeakKeyDictionary()


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Declare that ``module``'s forward uses ``parameter``, which belongs to another module.

    Under ZeRO-3 a unit's parameters exist only while the unit runs; a parameter also used
    elsewhere must be live there too. Call before ``slipstream.initialize`` (as with DeepSpeed's
    function of the same name); the parameter is then kept in the root unit.
    """
    if not isinstance(parameter, torch.nn.Parameter):
        raise TypeError(f"register_external_parameter: expected an nn.Parameter, got {type(parameter).__name__}")
    _external.setdefault(module, []).append(parameter)


@dataclasses.dataclass
class UnitSpec:
    index: int
    kind: UnitKind
    module: torch.nn.Module  # whose forward gathers it (the model itself for root and persistent)
    name: str  # qualified module name, for messages
    params: list[torch.nn.Parameter]

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)


def find_units(model: torch.nn.Module, unit_classes: list[str] | None, persistence_threshold: int) -> list[UnitSpec]:
    """Cut ``model`` into units, in forward order: root first, then blocks in registration order, persistent last."""
    roots = _unit_roots(model, unit_classes)
    root_of_module: dict[int, str] = {}
    for name, module in model.named_modules():
        owner = next((r for r in roots if name == r or name.startswith(r + ".")), "")
        root_of_module[id(module)] = owner
    owners: dict[int, set[str]] = {}
    params: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), set()).add(root_of_module[id(module)])
            params[id(p)] = p
    for module, used in _external.items():
        if id(module) in root_of_module:
            for p in used:
                if id(p) in owners:
                    owners[id(p)].add(root_of_module[id(module)] or "<external>")
    placed: dict[str, list[torch.nn.Parameter]] = {"": [], **{r: [] for r in roots}, "<persistent>": []}
    for key, p in params.items():
        if p.numel() < persistence_threshold:
            placed["<persistent>"].append(p)
        else:
            where = owners[key]
            placed[next(iter(where)) if len(where) == 1 else ""].append(p)
    modules = dict(model.named_modules())
    specs = [UnitSpec(0, "root", model, "<root>", placed[""])]
    specs += [UnitSpec(0, "block", modules[r], r, placed[r]) for r in roots if placed[r]]
    specs.append(UnitSpec(0, "persistent", model, "<persistent>", placed["<persistent>"]))
    specs = [s for s in specs if s.params]
    for i, spec in enumerate(specs):
        spec.index = i
    return specs


def _unit_roots(model: torch.nn.Module, unit_classes: list[str] | None) -> list[str]:
    """Qualified names of the outermost modules that become units."""
    roots: list[str] = []

    def inside_unit(name: str) -> bool:
        return any(name == r or name.startswith(r + ".") for r in roots)

    if unit_classes is not None:
        wanted = set(unit_classes)
        found = set()
        for name, module in model.named_modules():
            if name and type(module).__name__ in wanted and not inside_unit(name):
                roots.append(name)
                found.add(type(module).__name__)
        missing = wanted - found - {type(model).__name__}
        if missing:
            classes = sorted({type(m).__name__ for m in model.modules()})
            raise ConfigError(
                f"zero_optimization.stage3_unit_modules: no module of class {', '.join(sorted(missing))} in the model "
                f"(its classes: {', '.join(classes)})"
            )
        return roots
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)) and not inside_unit(name):
            children = [(n, c) for n, c in module.named_children() if any(True for _ in c.parameters())]
            if len(children) >= 2 and len({type(c) for _, c in children}) == 1:
                roots.extend(f"{name}.{n}" if name else n for n, _ in children)
    return roots
