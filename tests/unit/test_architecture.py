"""The import graph keeps the layering that DESIGN.md draws (standard library only, read from the
source with ``ast``; nothing is imported, so it takes a fraction of a second).

* No import cycle among ``slipstream`` modules, counting every import: top level, inside
  functions and under ``if TYPE_CHECKING:`` (a cycle hidden in a function is still a knot).
* ``slipstream.accelerator``, ``slipstream.comm`` and ``slipstream.ops`` never import
  ``slipstream.engine``, directly (any kind of import) or through other modules (what those import
  when they run: top level and in functions, not their ``TYPE_CHECKING`` blocks).
* ``slipstream.engine.parallel`` and ``slipstream.engine.zero`` never import each other (the engine
  composes them); ``checkpoint`` and ``monitor`` never import the ``Engine`` module or
  ``initialize`` (they are handed ``Stateful`` pieces and a step record); ``config`` never imports
  ``zero``. Paths are followed as for the engine rule above.
* No module-level ``Engine = ...`` (``Engine = Any`` and the like) outside ``engine/engine.py``: an
  alias that dodges an import cycle hides the dependency the rules above are about.
* The launcher (``slipstream/launcher/**``, the ``slipstream`` dispatcher ``slipstream/cli.py``
  and the console script's module) imports no torch at module level, so ``slipstream run --help``
  answers instantly; the launcher never imports ``slipstream.engine`` (the dispatcher may, inside
  the ``checkpoint`` subcommand).
* No file under ``slipstream/`` is longer than 600 lines.
* Only ``slipstream.comm`` calls ``torch.distributed``'s collectives and point-to-point transfers: every
  other module goes through comm, so the comms log, the flight recorder and the timeouts see each call.
* ``slipstream.comm`` keeps no module-level mutable state outside ``comm/process.py`` ([Note: one owner of
  comm's state]): no ``global`` statement, no module-level name bound to a mutable container or a lock
  (``ALL_CAPS`` tables of constants aside).
* The checkpoint formats (``engine/checkpoint/formats/<format>``) never import each other: the table in
  ``formats/__init__.py`` composes them (any kind of import).
* A piece of a global tensor has one home, ``slipstream.utils.pieces`` ([Note: a piece of a global
  tensor]): no other module binds ``Box``, declares a class with a box (or offsets) and a flat range
  (start and numel), or indexes a box by hand (``slice(o, o + n)``).

[Note: the graph's conventions] ``from a.b import c`` is an edge to ``a.b.c`` when that is a module,
else to ``a.b``; ``import a.b.c`` is an edge to ``a.b.c`` only (for cycles, importing a submodule
is not an edge to its parent packages). For "at module level" the parent packages Python executes
on the way count too. ``importlib.import_module("slipstream...")`` with a constant is an import.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict, deque
from collections.abc import Iterable, Iterator, Sequence
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "slipstream"
ENGINE = "slipstream.engine"
ENGINE_MODULE = "slipstream.engine.engine"  # the one place the name ``Engine`` is bound
INITIALIZE = "slipstream.engine.initialize"
PARALLEL = "slipstream.engine.parallel"
ZERO = "slipstream.engine.zero"
CONFIG = "slipstream.engine.config"
CORE_LAYERS = ("slipstream.accelerator", "slipstream.comm", "slipstream.ops")
DISPATCHER = "slipstream.cli"
MAX_FILE_LINES = 600

TOP, FUNCTION, TYPING = "top level", "in a function", "under TYPE_CHECKING"
RUNTIME = frozenset({TOP, FUNCTION})  # what a module imports when it runs
ANY = frozenset({TOP, FUNCTION, TYPING})

Sites = list[tuple[int, str]]  # (line, kind) of each import statement behind one edge
Edges = dict[str, dict[str, Sites]]


class _Imports(ast.NodeVisitor):
    """Every import of one module as (dotted name, is-a-from-import name, line, kind)."""

    def __init__(self, module: str, is_package: bool) -> None:
        self.package_parts = module.split(".") if is_package else module.split(".")[:-1]
        self.found: list[tuple[str, str | None, int, str]] = []  # (module, imported name, line, kind)
        self.functions = self.typing = 0

    def kind(self) -> str:
        return TYPING if self.typing else FUNCTION if self.functions else TOP

    def _function(self, node: ast.AST) -> None:
        self.functions += 1
        self.generic_visit(node)
        self.functions -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_If(self, node: ast.If) -> None:
        name = getattr(node.test, "id", getattr(node.test, "attr", None))  # TYPE_CHECKING, typing.TYPE_CHECKING
        if name != "TYPE_CHECKING":
            self.generic_visit(node)
            return
        self.typing += 1
        for child in node.body:
            self.visit(child)
        self.typing -= 1
        for child in node.orelse:
            self.visit(child)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.found.append((alias.name, None, node.lineno, self.kind()))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            parts = self.package_parts[: len(self.package_parts) - node.level + 1]
            base = ".".join(parts + ([node.module] if node.module else []))
        for alias in node.names:
            self.found.append((base, None if alias.name == "*" else alias.name, node.lineno, self.kind()))

    def visit_Call(self, node: ast.Call) -> None:
        name = getattr(node.func, "attr", getattr(node.func, "id", None))
        argument = node.args[0] if node.args else None
        if name in ("import_module", "__import__") and isinstance(argument, ast.Constant):
            if isinstance(argument.value, str) and argument.value.startswith(PACKAGE):
                self.found.append((argument.value, None, node.lineno, self.kind()))
        self.generic_visit(node)


class Graph:
    """The package's modules, the imports between them and the external modules each imports."""

    def __init__(self, root: Path) -> None:
        self.files: dict[str, Path] = {}
        for path in sorted((root / PACKAGE).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            self.files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
        self.edges: Edges = defaultdict(lambda: defaultdict(list))
        self.external: dict[str, list[tuple[str, int, str]]] = defaultdict(list)
        self.trees = {m: ast.parse(p.read_text(encoding="utf-8"), filename=str(p)) for m, p in self.files.items()}
        for module, path in self.files.items():
            collector = _Imports(module, path.name == "__init__.py")
            collector.visit(self.trees[module])
            for name, imported, line, kind in collector.found:
                submodule = f"{name}.{imported}" if imported else None
                target = submodule if submodule in self.files else self._resolve(name)
                if target is None:
                    self.external[module].append((name, line, kind))
                elif target != module:
                    self.edges[module][target].append((line, kind))

    def _resolve(self, name: str) -> str | None:
        parts = name.split(".")
        for end in range(len(parts), 0, -1):
            if ".".join(parts[:end]) in self.files:
                return ".".join(parts[:end])
        return None

    def under(self, *prefixes: str) -> set[str]:
        return {m for m in self.files if any(m == p or m.startswith(p + ".") for p in prefixes)}

    def where(self, module: str, line: int) -> str:
        return f"{self.files[module].relative_to(ROOT)}:{line}"

    def describe(self, path: list[str], first: frozenset[str], rest: frozenset[str]) -> str:
        hops = []
        for i, (a, b) in enumerate(zip(path, path[1:])):
            kinds = first if i == 0 else rest
            line, kind = next(((ln, k) for ln, k in self.edges[a][b] if k in kinds), self.edges[a][b][0])
            hops.append(f"{self.where(a, line)} ({kind}) -> {b}")
        return "; ".join(hops)


@cache
def graph() -> Graph:
    return Graph(ROOT)


def shortest_path(
    edges: Edges,
    start: str,
    goals: set[str],
    first: frozenset[str],
    rest: frozenset[str],
    allowed: set[str] | None = None,
) -> list[str] | None:
    """Breadth-first from ``start`` to any of ``goals``; an edge counts when one of its imports has a
    kind in ``first`` (edges leaving ``start``) or ``rest`` (every later edge)."""
    previous: dict[str, str | None] = {start: None}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        kinds = first if node == start else rest
        for target, sites in sorted(edges.get(node, {}).items()):
            if target in previous or (allowed is not None and target not in allowed):
                continue
            if not any(kind in kinds for _, kind in sites):
                continue
            previous[target] = node
            if target in goals:
                path = [target]
                while previous[path[-1]] is not None:
                    path.append(previous[path[-1]])  # type: ignore[arg-type]
                return path[::-1]
            queue.append(target)
    return None


def strongly_connected(nodes: Iterable[str], edges: Edges) -> list[set[str]]:
    """Kosaraju's components (two iterative depth-first passes)."""
    order: list[str] = []
    seen: set[str] = set()
    for start in nodes:
        if start in seen:
            continue
        seen.add(start)
        stack = [(start, iter(sorted(edges.get(start, {}))))]
        while stack:
            node, successors = stack[-1]
            nxt = next((s for s in successors if s not in seen), None)
            if nxt is None:
                order.append(node)
                stack.pop()
            else:
                seen.add(nxt)
                stack.append((nxt, iter(sorted(edges.get(nxt, {})))))
    reverse: dict[str, set[str]] = defaultdict(set)
    for source, targets in edges.items():
        for target in targets:
            reverse[target].add(source)
    components, assigned = [], set()
    for start in reversed(order):
        if start in assigned:
            continue
        component, todo = {start}, [start]
        assigned.add(start)
        while todo:
            for source in reverse[todo.pop()] - assigned:
                assigned.add(source)
                component.add(source)
                todo.append(source)
        components.append(component)
    return components


def import_cycles(g: Graph) -> list[str]:
    found = []
    for component in strongly_connected(sorted(g.files), g.edges):
        if len(component) < 2:
            continue
        start = min(component)
        back = [shortest_path(g.edges, t, {start}, ANY, ANY, component) for t in g.edges[start] if t in component]
        loop = [start, *min((path for path in back if path), key=len)]
        found.append(
            f"import cycle among {len(component)} modules ({', '.join(sorted(component))}): "
            + g.describe(loop, ANY, ANY)
        )
    return found


def imports_of(g: Graph, modules: Iterable[str], targets: set[str], rule: str) -> list[str]:
    """One violation per module that reaches ``targets``: by any import of its own, then through
    what the modules on the way import when they run (their ``TYPE_CHECKING`` blocks never run)."""
    found = []
    for module in sorted(modules):
        path = shortest_path(g.edges, module, targets, ANY, RUNTIME)
        if path:
            found.append(f"{module} imports {path[-1]} ({rule}): " + g.describe(path, ANY, RUNTIME))
    return found


def engine_imports(g: Graph, modules: Iterable[str], rule: str) -> list[str]:
    return imports_of(g, modules, g.under(ENGINE), rule)


def never_imports(g: Graph, sources: Sequence[str], targets: Sequence[str], rule: str) -> list[str]:
    """``imports_of`` from every module under the ``sources`` prefixes to those under ``targets``.

    A prefix that names no module fails: after a rename the rule would otherwise check nothing."""
    for prefix in (*sources, *targets):
        assert g.under(prefix), f"{prefix} names no module under {PACKAGE}/: the rule would check nothing"
    return imports_of(g, g.under(*sources), g.under(*targets), rule)


def module_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements that run when a module is imported: top level and inside ``if``/``try``/
    ``with``/loop/``match`` blocks (``if TYPE_CHECKING: ... else: Engine = Any`` included), not the
    bodies of functions and classes."""
    for node in body:
        yield node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for field in ("body", "orelse", "finalbody"):
            yield from module_level(getattr(node, field, []))
        for block in (*getattr(node, "handlers", ()), *getattr(node, "cases", ())):
            yield from module_level(block.body)


def bound_names(target: ast.expr) -> Iterator[str]:
    """The names an assignment target binds (``a``, ``a, *b``, ``[a, b]``; not ``x.a`` or ``x[a]``)."""
    if isinstance(target, ast.Name):
        yield target.id
    elif isinstance(target, (ast.Tuple, ast.List)):
        for element in target.elts:
            yield from bound_names(element)
    elif isinstance(target, ast.Starred):
        yield from bound_names(target.value)


def engine_aliases(tree: ast.Module) -> list[int]:
    """Lines of the module-level assignments (``=``, annotated, ``type`` statement) to ``Engine``."""
    lines = []
    for node in module_level(tree.body):
        targets: list[ast.expr]
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        elif type(node).__name__ == "TypeAlias":  # ``type Engine = ...`` (Python 3.12+)
            targets = [node.name]  # type: ignore[attr-defined]
        else:
            continue
        if any(name == "Engine" for target in targets for name in bound_names(target)):
            lines.append(node.lineno)
    return lines


def engine_alias_sites(g: Graph) -> list[str]:
    """Every module-level binding of ``Engine`` outside the Engine's own module."""
    owner = g.files[ENGINE_MODULE].relative_to(ROOT)
    return [
        f"{g.where(module, line)} binds the module-level name Engine (an alias that dodges an import cycle; "
        f"only {owner} defines Engine)"
        for module in sorted(g.files)
        if module != ENGINE_MODULE
        for line in engine_aliases(g.trees[module])
    ]


def launcher_modules(g: Graph) -> set[str]:
    setup = (ROOT / "setup.py").read_text(encoding="utf-8")
    console = set(re.findall(r"""slipstream\s*=\s*["']?([A-Za-z_][\w.]*)\s*:""", setup))
    return g.under(f"{PACKAGE}.launcher") | ({DISPATCHER} | console) & set(g.files)


def torch_at_module_level(g: Graph, modules: Iterable[str]) -> list[str]:
    """Modules that import torch when imported: directly, or through the modules (and parent
    packages) that their top-level imports execute."""
    executed: Edges = defaultdict(lambda: defaultdict(list))
    for source, targets in g.edges.items():
        for target, sites in targets.items():
            executed[source][target] += [site for site in sites if site[1] == TOP]
    for module in g.files:
        parts = module.split(".")
        for end in range(1, len(parts)):
            executed[module][".".join(parts[:end])].append((0, TOP))  # the parent packages run first
    torch_lines = {
        module: line
        for module, names in g.external.items()
        for name, line, kind in reversed(names)
        if kind == TOP and (name == "torch" or name.startswith("torch."))
    }
    found = []
    for module in sorted(modules):
        path = [module] if module in torch_lines else shortest_path(executed, module, set(torch_lines), ANY, ANY)
        if path:
            found.append(
                f"{module} imports torch at module level: {' -> '.join(path)} "
                f"({g.where(path[-1], torch_lines[path[-1]])})"
            )
    return found


def long_files(g: Graph) -> list[str]:
    found = []
    for path in sorted(g.files.values()):
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MAX_FILE_LINES:
            found.append(f"{path.relative_to(ROOT)} has {lines} lines (max {MAX_FILE_LINES}; split it by concern)")
    return found


COLLECTIVES = frozenset(
    {
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_object",
        "all_to_all",
        "all_to_all_single",
        "barrier",
        "batch_isend_irecv",
        "broadcast",
        "broadcast_object_list",
        "gather",
        "gather_object",
        "irecv",
        "isend",
        "monitored_barrier",
        "recv",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "scatter",
        "scatter_object_list",
        "send",
        "recv_object_list",
        "send_object_list",
        "P2POp",
    }
)


def collective_calls(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, name) of each call to a torch.distributed collective: through an alias of the module (``import
    torch.distributed as dist``, ``from torch import distributed``), the full path, or a name imported from it."""
    modules, names = set(), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "torch.distributed" and alias.asname:
                    modules.add(alias.asname)
        elif isinstance(node, ast.ImportFrom) and node.module in ("torch", "torch.distributed"):
            for alias in node.names:
                if node.module == "torch" and alias.name == "distributed":
                    modules.add(alias.asname or alias.name)
                elif node.module == "torch.distributed" and alias.name in COLLECTIVES:
                    names[alias.asname or alias.name] = alias.name
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id in names:
            found.append((node.lineno, names[func.id]))
        elif isinstance(func, ast.Attribute) and func.attr in COLLECTIVES:
            owner = ast.unparse(func.value)
            if owner in modules or owner == "torch.distributed":
                found.append((node.lineno, func.attr))
    return found


def collectives_outside_comm(g: Graph) -> list[str]:
    comm = g.under("slipstream.comm")
    return [
        f"{g.where(module, line)}: torch.distributed.{name} outside slipstream.comm (call it through comm: logged, recorded, timed out)"
        for module in sorted(set(g.files) - comm)
        for line, name in collective_calls(g.trees[module])
    ]


def test_no_import_cycle() -> None:
    cycles = import_cycles(graph())
    assert not cycles, "\n".join(cycles)


def test_accelerator_comm_and_ops_never_import_the_engine() -> None:
    g = graph()
    found = engine_imports(g, g.under(*CORE_LAYERS), "accelerator, comm and ops sit below the engine")
    assert not found, "\n".join(found)


def test_parallel_and_zero_never_import_each_other() -> None:
    g = graph()
    found = never_imports(g, [PARALLEL], [ZERO], "parallel never imports zero: the engine composes them")
    found += never_imports(g, [ZERO], [PARALLEL], "zero never imports parallel: the engine composes them")
    assert not found, "\n".join(found)


def test_checkpoint_and_monitor_never_import_the_engine_or_initialize() -> None:
    g = graph()
    rule = "checkpoint and monitor are handed Stateful pieces and a step record, never the Engine"
    found = never_imports(g, [f"{ENGINE}.checkpoint", f"{ENGINE}.monitor"], [ENGINE_MODULE, INITIALIZE], rule)
    assert not found, "\n".join(found)


def test_config_never_imports_zero() -> None:
    g = graph()
    found = never_imports(g, [CONFIG], [ZERO], "the config sits below zero: zero reads it, not the reverse")
    assert not found, "\n".join(found)


def test_no_module_level_engine_alias() -> None:
    found = engine_alias_sites(graph())
    assert not found, "\n".join(found)


def test_launcher_never_imports_the_engine() -> None:
    g = graph()
    found = engine_imports(g, launcher_modules(g) - {DISPATCHER}, "the launcher never imports the engine")
    assert not found, "\n".join(found)


def test_launcher_imports_no_torch_at_module_level() -> None:
    g = graph()
    assert {f"{PACKAGE}.launcher.cli", DISPATCHER} <= launcher_modules(g)
    found = torch_at_module_level(g, launcher_modules(g))
    assert not found, "\n".join(found)


def test_no_file_over_600_lines() -> None:
    found = long_files(graph())
    assert not found, "\n".join(found)


PIECES = "slipstream.utils.pieces"
COMM_STATE = "slipstream.comm.process"
MUTABLE = frozenset(
    {
        "list",
        "dict",
        "set",
        "defaultdict",
        "deque",
        "Counter",
        "OrderedDict",
        "WeakSet",
        "WeakKeyDictionary",
        "WeakValueDictionary",
        "local",
        "Lock",
        "RLock",
        "Condition",
        "Event",
        "CommsLog",
        "ProcessComm",
    }
)


def module_state(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, what) of each ``global`` statement and each module-level binding of a mutable object."""
    found = [(node.lineno, "a global statement") for node in ast.walk(tree) if isinstance(node, ast.Global)]
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        names = [t.id for t in targets if isinstance(t, ast.Name) and t.id != "__all__"]
        if not names:
            continue
        called = value.func.attr if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) else None
        called = value.func.id if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) else called
        display = isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp))
        if called in MUTABLE or (display and not all(n.isupper() for n in names)):
            found.append((node.lineno, f"{', '.join(names)} is mutable module state"))
    return found


def comm_state_outside_its_owner(g: Graph) -> list[str]:
    return [
        f"{g.files[module].relative_to(ROOT)}:{line}: {what} (keep it on comm/process.py's PROCESS)"
        for module in sorted(g.under("slipstream.comm"))
        if module != COMM_STATE
        for line, what in module_state(g.trees[module])
    ]


def test_no_module_level_comm_state() -> None:
    found = comm_state_outside_its_owner(graph())
    assert not found, "\n".join(found)


FORMATS = "slipstream.engine.checkpoint.formats"


def _format_of(module: str) -> str | None:
    """``native`` for ``...formats.native``, ``deepspeed`` for ``...formats.deepspeed.convert``; None for the table."""
    if not module.startswith(FORMATS + "."):
        return None
    return module[len(FORMATS) + 1 :].split(".")[0]


def formats_importing_each_other(g: Graph) -> list[str]:
    found = []
    for module in sorted(g.files):
        mine = _format_of(module)
        if mine is None:
            continue
        for target, sites in sorted(g.edges.get(module, {}).items()):
            theirs = _format_of(target)
            if theirs is not None and theirs != mine:
                found.append(
                    f"{module} imports {target} ({g.where(module, sites[0][0])}): formats meet only in the table"
                )
    return found


def test_checkpoint_formats_never_import_each_other() -> None:
    g = graph()
    assert {_format_of(m) for m in g.files} >= {"dcp", "deepspeed", "hf", "native"}
    found = formats_importing_each_other(g)
    assert not found, "\n".join(found)


def piece_reimplementations(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, what) of each place a module redoes the piece type: a module-level ``Box``, a class with a box
    and a flat range among its annotated fields, a ``slice(o, o + n)`` call (a box indexed by hand)."""
    found = []
    for node in tree.body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        if any(isinstance(t, ast.Name) and t.id == "Box" for t in targets):
            found.append((node.lineno, "binds Box"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            fields = {s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
            if fields & {"box", "offsets"} and {"start", "numel"} <= fields:
                found.append((node.lineno, f"class {node.name} is a piece of a global tensor"))
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "slice" and len(node.args) == 2:
            first, second = node.args
            if (
                isinstance(second, ast.BinOp)
                and isinstance(second.op, ast.Add)
                and ast.dump(second.left) == ast.dump(first)
            ):
                found.append((node.lineno, "indexes a box by hand"))
    return found


def piece_types_outside_home(g: Graph) -> list[str]:
    return [
        f"{g.files[module].relative_to(ROOT)}:{line}: {what} (use {PIECES})"
        for module in sorted(set(g.files) - {PIECES})
        for line, what in piece_reimplementations(g.trees[module])
    ]


def test_one_piece_type() -> None:
    found = piece_types_outside_home(graph())
    assert not found, "\n".join(found)


def test_only_comm_calls_collectives() -> None:
    found = collectives_outside_comm(graph())
    assert not found, "\n".join(found)


def test_the_checks_see_what_they_check() -> None:
    # A scan that silently found nothing would pass every test above.
    g = graph()
    assert len(g.files) > 50 and "slipstream.engine.engine" in g.files
    assert "slipstream.launcher.cli" in g.edges[DISPATCHER]
    assert torch_at_module_level(g, ["slipstream.engine.engine"])  # the engine does import torch
    assert engine_imports(g, [DISPATCHER], "the dispatcher may")  # through its checkpoint subcommand
    # Each "never" rule, pointed at pairs that really do import, finds the path (and its lines).
    assert never_imports(g, [INITIALIZE], [ZERO], "it does")  # initialize builds the ZeRO strategy
    assert never_imports(g, [INITIALIZE], [PARALLEL], "it does")  # ... and parallelizes the model
    assert never_imports(g, [INITIALIZE], [ENGINE_MODULE], "it does")  # ... and the Engine
    assert never_imports(g, [f"{ENGINE}.checkpoint"], [ZERO], "it does")  # the slices it saves
    through = never_imports(g, [DISPATCHER], [ZERO], "it does")  # in a function, then checkpoint's imports
    assert through and through[0].count(".py:") > 1, through
    typing_later = {"a": {"b": [(1, TOP)]}, "b": {"c": [(2, TYPING)]}}  # a later TYPE_CHECKING hop never runs
    assert shortest_path(typing_later, "a", {"c"}, ANY, RUNTIME) is None
    assert shortest_path(typing_later, "b", {"c"}, ANY, RUNTIME) == ["b", "c"]
    assert len(g.under(PARALLEL)) > 1 and len(g.under(ZERO)) > 1  # the prefixes take in the subpackages
    alias = "if TYPE_CHECKING:\n    pass\nelse:\n    Engine = Any\nEngine: TypeAlias = Any\na, *Engine = b\n"
    inside = "def f():\n    Engine = Any\nclass C:\n    Engine = Any\nx.Engine = Any\nEngines = Any\n"
    assert engine_aliases(ast.parse(alias)) == [4, 5, 6] and engine_aliases(ast.parse(inside)) == []
    assert any(
        m.startswith("slipstream.comm") and collective_calls(g.trees[m]) for m in g.files
    )  # comm's own calls are seen
    calls = (
        "import torch.distributed as d\nfrom torch import distributed\nfrom torch.distributed import barrier as b\n"
        "d.all_reduce(x)\ndistributed.send(x, 1)\ntorch.distributed.broadcast(x, 0)\nb()\nd.get_rank()\nother.all_reduce(x)\n"
    )
    assert collective_calls(ast.parse(calls)) == [(4, "all_reduce"), (5, "send"), (6, "broadcast"), (7, "barrier")]
    assert len(module_state(g.trees[COMM_STATE])) == 1  # its one binding, PROCESS, is seen
    kept = "_a = {}\nB = {1: 2}\n_c = threading.Lock()\nd = weakref.WeakSet()\ndef f():\n    global e\n__all__ = []\n"
    assert [line for line, _ in module_state(ast.parse(kept))] == [6, 1, 3, 4]
    assert _format_of(FORMATS) is None and _format_of(f"{FORMATS}.deepspeed.convert") == "deepspeed"
    assert any(_format_of(t) == "native" for t in g.edges[FORMATS])  # the table's own imports are edges it sees
    assert len(piece_reimplementations(g.trees[PIECES])) == 3  # its Box, ParamSlice and box_index are seen
    redone = (
        "Box = tuple\nclass P:\n    offsets: tuple\n    start: int\n    numel: int\n"
        "x = full[tuple(slice(o, o + s) for o, s in zip(a, b))]\ny = t[slice(a, b + a)]\n"
    )
    assert [line for line, _ in piece_reimplementations(ast.parse(redone))] == [1, 2, 6]
