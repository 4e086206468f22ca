"""The package's import graph: no cycle between its modules, and ``import jppo.config`` stays in the config layer.

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


def _targets(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool, modules: set[str]) -> set[str]:
    """The modules of jppo that ``node`` (in ``importer``) imports: ``pkg.mod`` itself, and for ``from pkg import
    name`` the submodule ``pkg.name`` when there is one, else ``pkg``. No edge to the parents of an imported module
    (Python runs them, but they are not what the importer depends on)."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in modules}
    base = node.module or ""
    if node.level:  # relative: from the importer's package
        package = importer if is_package else importer.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
    found = set()
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
    graph = {}
    for name, path in paths.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        edges = set()
        for node in _imports(tree):
            edges |= _targets(node, name, is_package, modules)
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


def test_no_import_cycle_between_modules():
    graph = import_graph()
    cycles = [a_cycle(graph, c) for c in strongly_connected(graph) if len(c) > 1]
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


# What ``import jppo.config`` may load besides the config layer itself (jppo.config, .schema, .load), and why:
CONFIG_LAYER_IMPORTS = {
    # what the schema composes: a component's own config dataclass and what its module imports
    "jppo.data", "jppo.data.datasets", "jppo.data.tasks", "jppo.data.tokenizer",  # DataConfig
    "jppo.rewards", "jppo.rewards.adapters", "jppo.rewards.overlong", "jppo.rewards.plugin",  # RewardConfig
    "jppo.rewards.reward_fn", "jppo.rewards.rules", "jppo.rewards.verify",
    "jppo.engine", "jppo.engine.config",  # ActorFields, CriticFields (jppo.engine exports lazily)
    "jppo.models", "jppo.models.lora", "jppo.models.config", "jppo.models.sharding",  # LoRAConfig
    "jppo.models.families",  # ModelConfig.family: the registered families (plain records, no arrays)
    "jppo.parallel", "jppo.parallel.mesh",  # the logical axes LoRA's adapters are placed with
    # ActorFields.rollout_correction: jppo.losses' package loads every loss term with it (layer 1, pure math)
    "jppo.losses", "jppo.losses.actor", "jppo.losses.aggregate", "jppo.losses.entropy", "jppo.losses.kl",
    "jppo.losses.policy", "jppo.losses.rollout_correction", "jppo.losses.value",
    # TrainConfig.use_critic asks the estimator registry (layer 1)
    "jppo.advantages", "jppo.advantages.estimate", "jppo.advantages.group", "jppo.advantages.registry",
    "jppo.advantages.returns",
    # the loader: model sources given as Hugging Face repo ids are resolved to local snapshots
    "jppo.models.hub",
}


def test_importing_the_config_loads_the_config_layer_only():
    """``import jppo.config`` loads the schema and the loader, what the schema composes and what those modules
    import (:data:`CONFIG_LAYER_IMPORTS`, with the reason of each), and jppo.core: not the validator nor the views
    (they load when a config is loaded and checked), nor any module of jppo.run, jppo.rollout, jppo.runlog, the
    update engine's programs or the decoder. A fresh interpreter, so no other test's imports count."""
    code = "import jppo.config, sys; print(' '.join(sorted(m for m in sys.modules if m.startswith('jppo'))))"
    loaded = set(subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.split())
    config_layer = {"jppo", "jppo.config", "jppo.config.schema", "jppo.config.load"}
    core = {name for name in import_graph() if name == "jppo.core" or name.startswith("jppo.core.")}
    unexpected = sorted(loaded - config_layer - core - CONFIG_LAYER_IMPORTS)
    assert not unexpected, f"import jppo.config loads {len(loaded)} modules, beyond the config layer: {unexpected}"
    assert config_layer <= loaded
