"""A package's exports, each loaded from its submodule when first asked for (PEP 562).

A package whose ``__init__`` imports every submodule makes ``import pkg.small`` load the whole package: Python runs
the package's ``__init__`` first. :func:`lazy_exports` keeps ``from pkg import name`` working while only the
submodule that defines ``name`` loads, and only then. The import graph test (tests/test_imports.py) reads the table
given here as the package's imports of those submodules.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping, Sequence


def lazy_exports(package: str, exports: Mapping[str, Sequence[str]]) -> tuple[Callable[[str], Any], list[str]]:
    """``(__getattr__, __all__)`` for ``package``: ``exports`` maps a submodule's name to the names it defines
    that the package exports. Assign both in the package's ``__init__``."""
    home = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str) -> Any:
        if name not in home:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{home[name]}"), name)

    return __getattr__, sorted(home)
