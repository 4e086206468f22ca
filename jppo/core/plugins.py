"""Loading a function a config names: ``path/to/file.py:fn`` or ``package.module:fn``.

Reward plug-ins (``reward.function``, :mod:`jppo.rewards.plugin`) and rollout environments (``rollout.env``,
:mod:`jppo.rollout.env`) are named the same way and loaded by :func:`load_function`. A file is executed once as a
module of its own (registered in ``sys.modules`` under a private ``jppo_reward_plugin_*`` name; ``sys.path`` is left
alone); any other name that is not an existing path nor ends in ``.py`` is imported as an installed module.
"""

from __future__ import annotations

import importlib.util
import inspect
import pathlib
import sys
import zlib
from typing import Any, Callable

from jppo.core.errors import error_line


def load_function(spec: str, key: str = "reward.function") -> Callable[..., Any]:
    """The callable ``fn`` of ``path/to/file.py:fn`` or ``package.module:fn``; errors name ``key`` and ``spec``
    (reward plug-ins and rollout environments are named the same way)."""
    path_text, colon, name = spec.rpartition(":")
    if not colon or not path_text or not name:
        raise ValueError(f"{key}={spec!r} is invalid: expected 'path/to/file.py:function_name'")
    if not path_text.endswith(".py") and not pathlib.Path(path_text).exists():
        return _from_module(path_text, name, spec, key)
    path = pathlib.Path(path_text)
    if not path.is_file():
        raise ValueError(f"{key}={spec!r}: file {str(path)!r} does not exist")
    module_name = f"jppo_reward_plugin_{path.stem}_{zlib.crc32(str(path.resolve()).encode()):08x}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise ValueError(f"{key}={spec!r}: {str(path)!r} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # dataclasses and typing look a class's module up there
    try:
        module_spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[module_name]
        raise ValueError(f"{key}={spec!r}: executing {str(path)!r} raised {error_line(error)}") from error
    function = getattr(module, name, None)
    if not callable(function):
        problem = "is not callable" if hasattr(module, name) else "does not exist"
        functions = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_"))
        raise ValueError(f"{key}={spec!r}: {name!r} {problem} in {str(path)!r}; its functions: {functions}")
    return function


def _from_module(module_name: str, name: str, spec: str, key: str) -> Callable[..., Any]:
    """``fn`` of an importable module ``package.module`` (a name that is not a file)."""
    try:
        module = importlib.import_module(module_name)
    except Exception as error:
        raise ValueError(
            f"{key}={spec!r}: {module_name!r} is neither a file nor an importable module "
            f"({error_line(error)})"
        ) from error
    function = getattr(module, name, None)
    if not callable(function):
        raise ValueError(f"{key}={spec!r}: module {module_name!r} has no function {name!r}")
    return function
