"""The checks of a config that the components register, so that the config layer runs them without importing them.

A component whose limits a config must respect (a registry's names, a model's shape, a cache folder, a checkpoint
to resume) registers a check of the whole config here, ``@register_config_check(name)`` over ``check(cfg)``, in
the module that knows the limit; it raises :class:`~jppo.core.errors.ConfigError` (one line naming the key and the
value). :func:`jppo.config.check.check` runs its own checks, then every registered one, in registration order.
A check runs when its module is loaded: every command loads them all (:mod:`jppo.run.checks`) before it
reads its config, and :mod:`jppo.run.build` loads them too and runs those a config loaded earlier has not passed
(:func:`run_missing_checks`), so nothing compiles on a config they have not seen.

The helpers below (:func:`choice`, :func:`positive`, :func:`within`, :func:`as_key`, :func:`check_local_dir`) word
every check's message alike, wherever it is registered.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import pathlib
from typing import Any, Callable, Sequence

from jppo.core.errors import ConfigError, InvalidSetting, one_line
from jppo.core.registry import Registry

ConfigCheck = Callable[[Any], None]  # check(cfg: TrainConfig) -> None, or ConfigError

CONFIG_CHECKS: Registry[ConfigCheck] = Registry("config check")


# the registered checks of what only an RL run reads: not run on an SFT config (python -m jppo.sft), whose keys
# of RL runs are refused when set (jppo.config.applies)
RL_ONLY_CHECKS: set[str] = set()


def register_config_check(name: str, rl_only: bool = False) -> Callable[[ConfigCheck], ConfigCheck]:
    """The decorator that registers a check of the whole config under ``name`` (a name registers once);
    ``rl_only``: a check of what only an RL run reads, not run on an SFT config."""
    if rl_only:
        RL_ONLY_CHECKS.add(name)
    return CONFIG_CHECKS.register(name)


# the attribute of a checked config that names the registered checks it passed (not a field: not saved, not
# compared, and a config made by dataclasses.replace starts without it)
_CHECKED = "_config_checks_passed"


def run_config_checks(cfg: Any, sft: bool = False) -> None:
    """Every registered check on ``cfg``, in registration order (``sft``: an SFT config, those of RL runs left
    out); the first problem raises. The config then records which checks it passed (:func:`run_missing_checks`)."""
    for name, check in CONFIG_CHECKS.items():
        if not (sft and name in RL_ONLY_CHECKS):
            check(cfg)
    object.__setattr__(cfg, _CHECKED, frozenset(CONFIG_CHECKS))  # a frozen dataclass: set past its __setattr__


def run_missing_checks(cfg: Any) -> None:
    """The registered checks a loaded config has not passed: those of the components loaded after it was loaded
    (a program that reads its config before it imports the run). Nothing for a config that was never loaded (made
    in code): what it holds is its maker's."""
    passed = getattr(cfg, _CHECKED, None)
    if passed is None or passed >= set(CONFIG_CHECKS):
        return
    for name, check in CONFIG_CHECKS.items():
        if name not in passed:
            check(cfg)
    object.__setattr__(cfg, _CHECKED, frozenset(CONFIG_CHECKS))


def choice(key: str, value: str, valid: Sequence[str]) -> None:
    """``value`` is one of ``valid``, else one line naming ``key`` and the valid values (and the closest one)."""
    if value not in valid:
        close = difflib.get_close_matches(value, list(valid), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{key}={value!r} is not valid{hint}; valid: {', '.join(valid)}")


def positive(key: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key}={value!r} must be {'>= 0' if allow_zero else '> 0'}")


def within(key: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise ConfigError(f"{key}={value!r} must be in [{low:g}, {high:g}]")


@contextlib.contextmanager
def as_key(keys: dict[str, str], prefix: str = ""):
    """Runs a component's own check; its :class:`InvalidSetting` becomes a :class:`ConfigError` under the config
    key that holds the setting (``keys[name]``, else ``prefix + name``)."""
    try:
        yield
    except InvalidSetting as error:
        key = keys.get(error.name, f"{prefix}{error.name}" if prefix else None)
        raise ConfigError(error.renamed(key) if key else one_line(error)) from None


def check_local_dir(key: str, value: str) -> None:
    """A local folder the run can create or write into: its nearest existing ancestor is a writable directory."""
    path = pathlib.Path(os.path.expanduser(value)).absolute()
    existing = next(parent for parent in (path, *path.parents) if parent.exists())
    if not existing.is_dir():
        raise ConfigError(f"{key}={value!r}: {str(existing)!r} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}={value!r}: {str(existing)!r} is not writable")
