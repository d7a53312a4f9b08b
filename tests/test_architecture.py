"""The architecture as tests: ddptrain's import graph has no cycle, among modules or among folders;
contract/ and config/ are the bottom layers; serving/ and export.py read runs without the training
loop; `import ddptrain` stays light; and docs/architecture.md draws every module there is.

The import graph is read from the source with `ast`, not by importing: every `import` and
`from ... import` statement anywhere in a file (inside functions, `if` blocks and `if TYPE_CHECKING:`
too) is an edge. `from ddptrain.pkg import name` is an edge to the submodule `ddptrain.pkg.name`
when there is one, else to `ddptrain/pkg/__init__.py`. The packages that Python imports on the way to a module
(`ddptrain/__init__.py` for every `ddptrain.x`) are not edges: a sub-module that reaches its parent
package's `__init__` is not a cycle by itself, but an `__init__` that imports a module which
imports that `__init__` back is. Module names given to `importlib.import_module` as strings (the
strategy registry's lazy imports) are data, not edges. The folder graph folds the module graph: a
sub-package (`ddptrain/engine/`) or a module at the top of the package (`ddptrain/export.py`) is one
node, and an arrow between two nodes stands for every statement that imports across them.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from tests.helpers import REPO

PACKAGE = REPO / "ddptrain"
ARCHITECTURE_PAGE = REPO / "docs" / "architecture.md"
ABOVE_CONFIG = ("ddptrain.engine", "ddptrain.strategies", "ddptrain.train", "ddptrain.models")


@dataclass(frozen=True)
class Edge:
    target: str  # the imported module's dotted name
    line: int  # where the statement is, in the importing file


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its name: its __init__.py)."""
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _relative(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def _resolve_from(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    """The absolute module that `from <module> import ...` names, relative levels resolved."""
    if not node.level:
        return node.module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _edges(name: str, path: Path) -> list[Edge]:
    """The ddptrain modules that the file's import statements name."""
    modules = _modules()
    edges = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            edges += [Edge(alias.name, node.lineno) for alias in node.names if alias.name in modules]
        elif isinstance(node, ast.ImportFrom):
            source = _resolve_from(node, name, path.name == "__init__.py")
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in modules:
                    edges.append(Edge(submodule, node.lineno))
                elif source in modules:
                    edges.append(Edge(source, node.lineno))
    return edges


@cache
def import_graph() -> dict[str, dict[str, int]]:
    """{importer: {imported: line of the first statement that imports it}} over ddptrain's modules."""
    graph: dict[str, dict[str, int]] = {}
    for name, path in _modules().items():
        targets: dict[str, int] = {}
        for edge in _edges(name, path):
            targets.setdefault(edge.target, edge.line)
        graph[name] = targets
    return graph


def _strongly_connected(graph: dict[str, dict]) -> list[list[str]]:
    """Tarjan's strongly connected components, iteratively (no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return components


def _shortest_cycle(graph: dict[str, dict], component: list[str]) -> list[str]:
    """A shortest cycle through the component's first module, as [a, b, ..., a]."""
    members = set(component)
    start = component[0]
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node]):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [*reversed(path), start]
                if child in members and child not in parents:
                    parents[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"{component} is not a cycle")


def _describe(graph: dict[str, dict[str, int]], chain: list[str]) -> str:
    """`a -> b -> a` and, below it, the statement behind each arrow."""
    steps = [f"      {_relative(_modules()[a])}:{graph[a][b]} imports {b}" for a, b in zip(chain, chain[1:])]
    return "  " + " -> ".join(chain) + "\n" + "\n".join(steps)


def import_cycles() -> list[list[str]]:
    graph = import_graph()
    cycles = [_shortest_cycle(graph, c) for c in _strongly_connected(graph) if len(c) > 1]
    cycles += [[name, name] for name, targets in graph.items() if name in targets]
    return sorted(cycles)


def folder_of(module: str) -> str:
    """The folder-level node of a module: its sub-package (`ddptrain.engine` for `ddptrain.engine.stats`),
    or the module itself at the top of the package (`ddptrain.export`; `ddptrain` is its __init__.py)."""
    return ".".join(module.split(".")[:2])


@cache
def folder_graph() -> dict[str, dict[str, list[tuple[str, str]]]]:
    """{folder: {imported folder: [(importing module, imported module), ...]}}: the import graph with
    each folder as one node; imports inside a folder are not arrows."""
    graph: dict[str, dict[str, list[tuple[str, str]]]] = {folder_of(name): {} for name in _modules()}
    for importer, targets in import_graph().items():
        for target in targets:
            if folder_of(importer) != folder_of(target):
                graph[folder_of(importer)].setdefault(folder_of(target), []).append((importer, target))
    return graph


def _describe_folders(chain: list[str]) -> str:
    """`a -> b -> a` between folders and, below each arrow, every statement behind it."""
    graph, modules = folder_graph(), import_graph()
    lines = ["  " + " -> ".join(chain)]
    for a, b in zip(chain, chain[1:]):
        lines.append(f"    {a} -> {b}:")
        lines += [f"      {_relative(_modules()[importer])}:{modules[importer][target]} imports {target}"
                  for importer, target in graph[a][b]]
    return "\n".join(lines)


def folder_cycles() -> list[list[str]]:
    graph = folder_graph()
    return sorted(_shortest_cycle(graph, c) for c in _strongly_connected(graph) if len(c) > 1)


def test_the_import_graph_reads_every_module():
    """Guards the checks below: relative imports resolve, and the known edges are there."""
    graph = import_graph()
    assert len(graph) == len(list(PACKAGE.rglob("*.py")))
    assert "ddptrain.distributed" in graph["ddptrain.testing"]
    assert "ddptrain.strategies.base" in graph["ddptrain.strategies"]
    assert any(target.startswith("ddptrain.engine") for target in graph["ddptrain.train.trainer"])


def test_no_import_cycle():
    """No cycle in ddptrain's imports, not even through an import inside a function."""
    graph = import_graph()
    cycles = import_cycles()
    assert not cycles, (f"{len(cycles)} import cycle(s) in ddptrain (a shortest cycle per group of modules that "
                        "import each other; imports inside functions count):\n"
                        + "\n".join(_describe(graph, cycle) for cycle in cycles))


def test_the_folder_graph_folds_the_import_graph():
    """Guards the folder checks: one node per sub-package and top-level module, arrows only across."""
    graph = folder_graph()
    assert {"ddptrain", "ddptrain.engine", "ddptrain.contract", "ddptrain.export", "ddptrain.train"} <= set(graph)
    assert not any(folder in targets for folder, targets in graph.items())
    assert any(importer == "ddptrain.train.trainer" for importer, _ in graph["ddptrain.train"]["ddptrain.engine"])


def test_no_import_cycle_among_folders():
    """No cycle among ddptrain's folders (sub-packages and top-level modules), counting imports inside
    functions: two folders that each import the other are one knot, even when their files are not."""
    cycles = folder_cycles()
    assert not cycles, (f"{len(cycles)} import cycle(s) among ddptrain's folders (a shortest cycle per group of "
                        "folders that import each other; imports inside functions count):\n"
                        + "\n".join(_describe_folders(cycle) for cycle in cycles))


def _chain_to(graph: dict[str, dict[str, int]], start: str, is_target) -> list[str] | None:
    """The shortest import chain from `start` to a module for which `is_target` holds."""
    parents = {start: ""}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node]):
                if child in parents:
                    continue
                parents[child] = node
                if is_target(child):
                    chain = [child]
                    while chain[-1] != start:
                        chain.append(parents[chain[-1]])
                    return chain[::-1]
                following.append(child)
        frontier = following
    return None


def _in(name: str, folders: tuple[str, ...]) -> bool:
    return folder_of(name) in folders


def _chains(sources: tuple[str, ...], is_target) -> list[list[str]]:
    """For every module in `sources` (folders) that reaches a module for which `is_target` holds,
    directly or through other modules, the shortest such chain."""
    graph = import_graph()
    return [chain for name in sorted(graph) if _in(name, sources)
            if (chain := _chain_to(graph, name, is_target)) is not None]


def test_config_is_the_bottom_layer():
    """ddptrain/config/ reaches none of engine, strategies, train and models, directly or through
    another module: the config is built and validated before any of them exists."""
    chains = _chains(("ddptrain.config",), lambda name: _in(name, ABOVE_CONFIG))
    assert not chains, ("ddptrain/config/ must import nothing from " + ", ".join(ABOVE_CONFIG) + ":\n"
                        + "\n".join(_describe(import_graph(), chain) for chain in chains))


def test_contract_imports_nothing_else_of_ddptrain():
    """ddptrain/contract/ is the vocabulary every layer shares (the ignore index, logits, document
    boundaries, blocks): below everything, so any layer may import it without a cycle."""
    chains = _chains(("ddptrain.contract",), lambda name: not _in(name, ("ddptrain.contract",)))
    assert not chains, ("ddptrain/contract/ must import nothing else of ddptrain:\n"
                        + "\n".join(_describe(import_graph(), chain) for chain in chains))


def test_serving_and_export_do_not_import_the_training_loop():
    """A run directory is read through ddptrain/runs/: serving/ and export.py reach nothing in
    ddptrain/train/, directly or through another module."""
    chains = _chains(("ddptrain.serving", "ddptrain.export"), lambda name: _in(name, ("ddptrain.train",)))
    assert not chains, ("ddptrain/serving/ and ddptrain/export.py must import nothing from ddptrain/train/ "
                        "(read runs through ddptrain/runs/):\n"
                        + "\n".join(_describe(import_graph(), chain) for chain in chains))


def test_generation_sits_below_training_serving_and_rl():
    """ddptrain/generation/ is what both the server and the RL rollouts generate with: it reaches none of
    train/, serving/ and rl/, directly or through another module, so both may import it."""
    above = ("ddptrain.train", "ddptrain.serving", "ddptrain.rl")
    chains = _chains(("ddptrain.generation",), lambda name: _in(name, above))
    assert not chains, ("ddptrain/generation/ must import nothing from " + ", ".join(above) + ":\n"
                        + "\n".join(_describe(import_graph(), chain) for chain in chains))
    graph = folder_graph()
    assert "ddptrain.generation" in graph["ddptrain.serving"] and "ddptrain.generation" in graph["ddptrain.rl"]


# -- what `import ddptrain` loads -------------------------------------------------------------


def _loaded_after(code: str) -> set[str]:
    """The modules in sys.modules after running `code` in a fresh interpreter."""
    probe = f"{code}\nimport sys\nprint('\\n'.join(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return set(result.stdout.split())


def _heavy(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if m == "deepspeed" or m.startswith(("deepspeed.", "ddptrain.strategies")))


def test_import_ddptrain_loads_no_strategy_and_no_deepspeed():
    """`import ddptrain` is the library's front door: the strategies (and DeepSpeed behind them)
    load when an Engine is built, not before (ddptrain/__init__.py resolves names lazily)."""
    heavy = _heavy(_loaded_after("import ddptrain"))
    assert not heavy, f"`import ddptrain` imported {heavy}"


def test_plot_command_loads_no_strategy():
    """`python -m ddptrain.plot --help` reads metrics.jsonl files: it needs no strategy."""
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "ddptrain.plot", "--help"], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    imported = {line.rsplit("|", 1)[1].strip() for line in result.stderr.splitlines()
                if line.startswith("import time:") and line.count("|") == 2}
    assert "ddptrain.plot" in imported or "ddptrain" in imported, result.stderr[-3000:]
    heavy = _heavy(imported)
    assert not heavy, f"`python -m ddptrain.plot --help` imported {heavy}"


# -- docs/architecture.md ----------------------------------------------------------------------

_ENTRY = re.compile(r"^(?P<lead>[\s│├└─]*)(?P<name>[\w.]+(?:/[\w.]+)*(?:\.py|/))(?:\s|$)")


def drawn_modules() -> set[str]:
    """The .py paths (relative to ddptrain/) that the page's tree drawing names.

    The drawing is the fenced block whose first line is `ddptrain/`. An entry is a line whose first
    word ends in `.py` or `/`; its indentation (box-drawing characters count as indentation) says
    which folder holds it, so a folder's modules may be written by name (`checkpoint.py` under
    `train/`) or by path (`runs/store.py`). Other lines are descriptions.
    """
    blocks = re.findall(r"^```\w*\n(ddptrain/[^\n]*\n.*?)^```", ARCHITECTURE_PAGE.read_text(), flags=re.S | re.M)
    assert blocks, f"{ARCHITECTURE_PAGE.name} has no tree drawing (a fenced block starting with a `ddptrain/` line)"
    drawn: set[str] = set()
    folders: list[tuple[int, str]] = []  # (column, folder path) of the open folders
    for line in blocks[0].splitlines()[1:]:
        entry = _ENTRY.match(line)
        if not entry:
            continue
        column = len(entry["lead"])
        while folders and folders[-1][0] >= column:
            folders.pop()
        path = "/".join([folders[-1][1]] if folders else []) + ("/" if folders else "") + entry["name"]
        if path.endswith("/"):
            folders.append((column, path.rstrip("/")))
        else:
            drawn.add(path)
    return drawn


def test_architecture_page_draws_every_module():
    modules = {_relative(path) for path in _modules().values()}
    missing = sorted(modules - drawn_modules())
    assert not missing, (f"docs/architecture.md's tree drawing does not name {len(missing)} module(s) of ddptrain/ "
                         f"(write each with one line on what it holds): {', '.join(missing)}")


def test_architecture_page_draws_no_module_that_does_not_exist():
    modules = {_relative(path) for path in _modules().values()}
    extra = sorted(drawn_modules() - modules)
    assert not extra, f"docs/architecture.md draws module(s) that ddptrain/ does not have: {', '.join(extra)}"


def test_pyproject_ships_every_sub_package():
    """The wheel (and so the Docker image) carries a sub-package only when pyproject.toml lists it."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {".".join(path.parent.relative_to(REPO).parts) for path in PACKAGE.rglob("__init__.py")}
    assert packages - listed == set(), f"pyproject.toml's [tool.setuptools] packages misses {sorted(packages - listed)}"


# -- tests/ ------------------------------------------------------------------------------------


def test_every_test_module_in_tests_system_is_marked_system():
    """tests/system/ holds what needs root and changes the machine: its `pytestmark` carries the
    `system` marker, so that `-m "not system"` leaves every one of its tests out."""
    unmarked = []
    for path in sorted((REPO / "tests" / "system").glob("test_*.py")):
        marks = [ast.unparse(node.value) for node in ast.parse(path.read_text()).body
                 if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets)]
        if not any("pytest.mark.system" in mark for mark in marks):
            unmarked.append(path.name)
    assert not unmarked, f"tests/system/ modules without pytestmark = pytest.mark.system: {', '.join(unmarked)}"
