"""The package's import graph: no import from a lower layer up to a higher one, no cycle between its modules, and
``import jppo.config`` stays in the config layer.

A cycle held apart by an import inside a function still ties its modules into one: neither can be read, tested or
moved without the other, and which one loads first decides whether the program starts. The graph is read from the
source with :mod:`ast`, every import at module level and inside functions (those under ``if TYPE_CHECKING:`` are
annotations only and are skipped), so the test sees what a reader sees, whatever order the modules happen to load in.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jppo"


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST):
    """Every import node of ``tree``, in functions too, except those under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _targets(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool, modules: set[str],
             packages: frozenset[str] = frozenset()) -> set[str]:
    """The modules of jppo that ``node`` (in ``importer``) imports: ``pkg.mod`` itself, and for ``from pkg import
    name`` the submodule ``pkg.name`` when there is one, else ``pkg``. ``from pkg import name`` of a package (one of
    ``packages``) also reads the package's namespace, so it depends on the package's ``__init__`` and what that
    imports: a module that its own package's ``__init__`` imports and that imports its siblings this way closes a
    cycle through the ``__init__`` (it works only while the half-run ``__init__`` happens to hold the name). No edge
    to the parents of ``import pkg.mod`` or ``from pkg.mod import name`` (Python runs them, but the importer reads
    only the module)."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in modules}
    base = node.module or ""
    if node.level:  # relative: from the importer's package
        package = importer if is_package else importer.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
    found = {base} if base in packages else set()
    for alias in node.names:
        child = f"{base}.{alias.name}"
        if child in modules:
            found.add(child)
        elif base in modules:
            found.add(base)
    return found


def _lazy_exports(tree: ast.AST) -> set[str]:
    """The submodules a package's ``lazy_exports(__name__, {submodule: names})`` loads (:mod:`jppo.core.lazy`)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "lazy_exports":
            table = node.args[1]
            found |= {key.value for key in table.keys if isinstance(key, ast.Constant)}
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of jppo it imports (itself excluded)."""
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    modules = set(paths)
    packages = frozenset(name for name, path in paths.items() if path.name == "__init__.py")
    graph = {}
    for name, path in paths.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        edges = set()
        for node in _imports(tree):
            edges |= _targets(node, name, is_package, modules, packages)
        if is_package:
            edges |= {f"{name}.{child}" for child in _lazy_exports(tree)}
        graph[name] = edges - {name}
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of ``graph``, iteratively (no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components = []
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
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
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
    return components


def a_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One cycle through the first module of ``component``, as a path that ends where it starts."""
    members, start = set(component), component[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:  # breadth first: the shortest way back to the start
        node = frontier.pop(0)
        for child in sorted(graph[node] & members):
            if child == start:
                return paths[node] + [start]
            if child not in paths:
                paths[child] = paths[node] + [child]
                frontier.append(child)
    return component


def test_the_graph_sees_imports_in_functions_and_skips_type_checking():
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "import jppo.a\n"
        "if TYPE_CHECKING:\n    from jppo.b import B\n"
        "def f():\n    from jppo import c\n    from jppo.d import D\n"
    )
    modules = {"jppo", "jppo.a", "jppo.b", "jppo.c", "jppo.d", "jppo.e"}
    found = set().union(*(_targets(node, "jppo.e", False, modules) for node in _imports(tree)))
    assert found == {"jppo.a", "jppo.c", "jppo.d"}
    package = ast.parse('__getattr__, __all__ = lazy_exports(__name__, {"a": ("A",), "b": ("B", "C")})')
    assert _lazy_exports(package) == {"a", "b"}
    cyclic = {"jppo.a": {"jppo.b"}, "jppo.b": {"jppo.c"}, "jppo.c": {"jppo.a"}, "jppo.d": {"jppo.a"}}
    components = [c for c in strongly_connected(cyclic) if len(c) > 1]
    assert components == [["jppo.a", "jppo.b", "jppo.c"]]
    assert a_cycle(cyclic, components[0]) == ["jppo.a", "jppo.b", "jppo.c", "jppo.a"]
    # a sibling taken from its package's namespace depends on the package's __init__ (which may import the importer)
    sibling = ast.parse("from jppo.p import b\nimport jppo.p.c as c\n")
    modules, packages = {"jppo", "jppo.p", "jppo.p.a", "jppo.p.b", "jppo.p.c"}, frozenset({"jppo", "jppo.p"})
    found = set().union(*(_targets(node, "jppo.p.a", False, modules, packages) for node in _imports(sibling)))
    assert found == {"jppo.p", "jppo.p.b", "jppo.p.c"}


# The floors of the house, the ground first (docs/layout.md draws them): a module imports only from its own floor
# and the floors below. Each package of jppo stands on one floor, so a new package must be placed here.
FLOORS = (
    ("core",),                                            # the batch type, masked reductions, metric pairs, registries
    ("losses", "advantages", "parallel", "data", "runlog"),  # pure math; devices and processes; prompts; reports
    ("models",),                                          # the decoder, its layout, LoRA, Hugging Face files
    ("engine", "rollout"),                                # the jitted programs: an update, the sampler
    ("rewards",),                                         # scoring responses (a reward model runs the engine)
    ("config",),                                          # the typed configuration and its views per component
    ("run",),                                             # the training run, RL and SFT
    ("preflight",),                                       # before a run: the memory plan, compiling for a target,
                                                          # the audit
    ("cli",),                                             # the commands' shared plumbing
    ("train", "sft", "eval", "audit", "export", "plan", "plot", "serve"),  # the commands
)


def floor_of(module: str) -> int:
    """The floor of ``module`` (``jppo``, the package's face, is the ground: it imports nothing)."""
    parts = module.split(".")
    if len(parts) == 1:
        return 0
    return next(i for i, names in enumerate(FLOORS) if parts[1] in names)


def test_every_package_stands_on_a_floor():
    unplaced = sorted({m.split(".")[1] for m in import_graph() if "." in m} - {n for f in FLOORS for n in f})
    assert not unplaced, f"packages on no floor of FLOORS (place them): {unplaced}"


def test_no_import_runs_back_up_a_floor():
    graph = import_graph()
    upward = sorted((a, b) for a, edges in graph.items() for b in edges if floor_of(b) > floor_of(a))
    assert not upward, "imports from a lower floor up to a higher one:\n" + "\n".join(f"{a} -> {b}" for a, b in upward)


def test_no_import_cycle_between_modules():
    graph = import_graph()
    cycles = [a_cycle(graph, c) for c in strongly_connected(graph) if len(c) > 1]
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def _loaded_modules(code: str) -> set[str]:
    """The jppo modules a fresh interpreter holds after running ``code`` (no other test's imports count)."""
    code += "\nimport sys; print(' '.join(sorted(m for m in sys.modules if m.startswith('jppo'))))"
    return set(subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.split())


def test_loading_and_checking_a_config_loads_the_config_layer_and_core_only():
    """``import jppo.config`` and ``load_config`` of a shipped config (its every check that needs the config alone)
    load jppo, jppo.config.* and jppo.core.* only: the records the schema composes live in jppo.core, and the
    components' checks register themselves (jppo.core.checks) where they live. Every shipped quickstart (a critic,
    critic-free estimators, LoRA, DAPO, multi-turn tools). A config naming a Hugging Face repo id also loads the
    cache's reader (jppo.models.hub) to resolve it."""
    imported = _loaded_modules("import jppo.config")
    loaded = _loaded_modules("import glob, jppo.config\nfor path in sorted(glob.glob('configs/quickstart*.yaml')):\n"
                             "    jppo.config.load_config(path)")
    allowed = lambda name: name == "jppo" or name.startswith(("jppo.config.", "jppo.core.")) or name in (  # noqa: E731
        "jppo.config", "jppo.core")
    for what, modules in (("import jppo.config", imported), ("load_config", loaded)):
        beyond = sorted(name for name in modules if not allowed(name))
        assert not beyond, f"{what} loads {len(modules)} modules, beyond the config layer and core: {beyond}"
    assert {"jppo.config.load", "jppo.config.schema"} <= imported
    assert {"jppo.config.check", "jppo.core.checks"} <= loaded
    assert "jppo.run.checks" not in loaded  # the components' checks load with the components


def test_every_component_check_is_loaded_by_every_command():
    """What registers a check of a config is imported by :mod:`jppo.run.checks`, which every command
    loads before it reads its config (``cli.load_config``) and ``jppo.run.build`` loads with the models."""
    graph = import_graph()
    registering = {name for name, path in ((module_name(p), p) for p in PACKAGE.rglob("*.py"))
                   if "@register_config_check(" in path.read_text() and name != "jppo.core.checks"}
    assert registering >= {"jppo.run.checks", "jppo.data.tasks", "jppo.rewards.reward_fn",
                           "jppo.parallel.compile_cache", "jppo.run.filters", "jppo.runlog"}
    reached, frontier = set(), ["jppo.run.checks"]
    while frontier:
        node = frontier.pop()
        if node not in reached:
            reached.add(node)
            frontier.extend(graph[node])
    assert registering <= reached, f"not loaded with the components' checks: {sorted(registering - reached)}"
    assert "jppo.run.checks" in graph["jppo.cli"] and "jppo.run.checks" in graph["jppo.run.build"]
