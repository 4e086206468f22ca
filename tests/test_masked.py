"""The bottom layer of the numerics (``jppo.core.masked``): its statistics at the edges, and the import layering
above it.

Layering (checked on the source, without importing it): ``jppo.core.masked`` imports nothing from jppo but
``jppo.core.errors``; ``jppo.core.metrics`` builds on ``jppo.core.masked`` only; ``jppo.losses`` on ``jppo.core.masked``
and ``jppo.core.metrics``; ``jppo.advantages`` on ``jppo.core.masked`` only; and no import cycle runs through these
modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jppo.core.masked import masked_mean, masked_var, masked_whiten

PACKAGE = Path(__file__).resolve().parent.parent / "jppo"


@pytest.fixture(autouse=True)
def _float64():
    with jax.enable_x64(True):
        yield


def test_masked_statistics_of_few_or_no_valid_entries_are_zero() -> None:
    x = jnp.array([[3.0, jnp.nan, -jnp.inf], [jnp.inf, 2.0, 1.0]])
    one_valid = jnp.array([[0, 0, 0], [0, 1, 0]])
    none_valid = jnp.zeros_like(one_valid)
    assert float(masked_mean(x, one_valid)) == 2.0
    assert float(masked_var(x, one_valid)) == 0.0  # unbiased variance of one entry: verl raises
    assert float(masked_var(x, one_valid, unbiased=False)) == 0.0
    np.testing.assert_array_equal(masked_whiten(x, one_valid), np.zeros((2, 3)))
    np.testing.assert_array_equal(masked_whiten(x, one_valid, shift_mean=False), [[0, 0, 0], [0, 2.0, 0]])
    assert float(masked_mean(x, none_valid)) == 0.0
    assert float(masked_var(x, none_valid)) == 0.0
    np.testing.assert_array_equal(masked_mean(x, one_valid, axis=1), [0.0, 2.0])
    np.testing.assert_array_equal(masked_whiten(x, none_valid), np.zeros((2, 3)))


# ---------------------------------------------------------------------------------------------------- layering


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """For every module of jppo, the jppo modules whose code runs when it is imported.

    ``from a.b import c`` runs ``a.b`` and, when ``a/b/c.py`` exists, ``a.b.c``; importing ``a.b.c`` runs the
    package ``a.b`` first. A package the importer lives in is left out: it is already being imported.
    """
    modules = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                imported = [alias.name for alias in node.names]
            else:
                continue
            for module in imported:
                if module not in modules:
                    continue
                parts = module.split(".")
                for depth in range(2, len(parts) + 1):  # the packages on the way down, then the module itself
                    prefix = ".".join(parts[:depth])
                    inside = package == prefix or package.startswith(prefix + ".")
                    if prefix in modules and not inside:
                        targets.add(prefix)
        graph[name] = targets - {name}
    return graph


def cycles(graph: dict[str, set[str]], nodes: set[str]) -> list[list[str]]:
    """The import cycles among ``nodes`` (each found once per entry point; empty when there is none)."""
    found, done = [], set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            found.append(path[path.index(node) :] + [node])
            return
        if node in done:
            return
        for target in sorted(graph[node] & nodes):
            visit(target, path + [node])
        done.add(node)

    for node in sorted(nodes):
        visit(node, [])
    return found


def _numerics(graph: dict[str, set[str]]) -> set[str]:
    return {
        name
        for name in graph
        if name in ("jppo.core.masked", "jppo.core.metrics") or name.startswith(("jppo.losses", "jppo.advantages"))
    }


def test_numerics_have_no_import_cycle() -> None:
    graph = import_graph()
    numerics = _numerics(graph)
    assert {"jppo.core.masked", "jppo.core.metrics", "jppo.losses.aggregate", "jppo.advantages.group"} <= numerics
    assert cycles(graph, numerics) == []


@pytest.mark.parametrize(
    "layer, allowed",
    [
        ("jppo.core.masked", ("jppo.core.errors",)),
        ("jppo.core.metrics", ("jppo.core.masked",)),
        ("jppo.advantages", ("jppo.core.masked", "jppo.core.registry", "jppo.advantages")),
        ("jppo.losses", ("jppo.core.masked", "jppo.core.metrics", "jppo.core.errors", "jppo.core.registry",
                         "jppo.core.settings", "jppo.losses")),
    ],
)
def test_numerics_import_only_the_layers_below(layer: str, allowed: tuple[str, ...]) -> None:
    graph = import_graph()
    # a package whose __init__ imports nothing (jppo.core) runs no code of another layer: passing through it is free
    empty = {
        name for name, targets in graph.items() if not targets and (PACKAGE.parent / name.replace(".", "/")).is_dir()
    }
    for name in sorted(graph):
        if name == layer or name.startswith(layer + "."):
            outside = {t for t in graph[name] - empty if not any(t == a or t.startswith(a + ".") for a in allowed)}
            assert not outside, f"{name} imports {sorted(outside)}"
