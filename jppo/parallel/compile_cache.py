"""The persistent XLA compilation cache of the command-line runs (``trainer.compilation_cache``).

A run compiles each of its programs (sampler, forward passes, update step, ...) once, on the first step; at a
GSM8K-like shape on CPU that is most of the first step's extra time. With the cache on, XLA's output is written
to a folder keyed by the program and its shapes, and a later run of the same shapes (a restart, a resume, a second
seed) reads it back instead of compiling: only tracing and lowering remain.

``trainer.compilation_cache``:

* ``auto`` (default): the JAX cache folder already configured (``JAX_COMPILATION_CACHE_DIR`` or the program's own
  ``jax_compilation_cache_dir``), used as configured; otherwise ``$XDG_CACHE_HOME/jppo/xla`` (without
  ``XDG_CACHE_HOME``: ``~/.cache/jppo/xla``);
* ``off`` (also ``none``, ``null``, YAML's null and false, in any case): no persistent cache, even where JAX has one
  configured;
* any other value: that local folder, absolute or under ``~``. A relative folder is refused: it would be created in
  whichever directory the command happens to run from.

A folder jppo chooses (the default or a path) caches every program, however quick to compile (JAX's own default
skips those under a second, which at small shapes are most of them), and is bounded to :data:`MAX_BYTES`, the
least recently used entries evicted first. Only the entry points (``python -m jppo.train`` / ``jppo.eval``) turn it
on; the library functions leave JAX's settings as they find them.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Mapping, Optional

import jax

from jppo.core.checks import as_key, check_local_dir, register_config_check
from jppo.core.errors import InvalidSetting

AUTO = "auto"
OFF = "off"
# The words a setting may be written as, compared without case. YAML reads an unquoted off / no / false (on / yes /
# true) as a boolean, which the string key then holds as "False" ("True"); none and null (YAML's null reaches the
# key as None) are how many users write "off". None of them is a folder's name.
SPELLINGS = {"auto": AUTO, "true": AUTO, "off": OFF, "false": OFF, "none": OFF, "null": OFF}
VALID = f"{AUTO!r}, {OFF!r} or an absolute local folder (~/... allowed)"
MAX_BYTES = 4 * 2**30  # the chosen folder's bound; the least recently used entries go first


@dataclasses.dataclass(frozen=True)
class CacheChoice:
    """What to do with JAX's cache: ``folder`` None with ``enabled`` False turns it off; ``folder`` None with
    ``enabled`` True leaves JAX's own configuration alone; a folder is jppo's choice (every program cached)."""

    enabled: bool
    folder: Optional[pathlib.Path] = None


def default_folder(environ: Mapping[str, str]) -> pathlib.Path:
    """``$XDG_CACHE_HOME/jppo/xla``, or ``~/.cache/jppo/xla`` when that variable is unset or empty."""
    base = environ.get("XDG_CACHE_HOME") or os.path.join(environ.get("HOME") or os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "jppo" / "xla"


def normalize(setting: Optional[str]) -> str:
    """:data:`AUTO` or :data:`OFF` for any of their :data:`SPELLINGS` (None: off), else ``setting`` as written."""
    if setting is None:
        return OFF
    return SPELLINGS.get(setting.strip().lower(), setting)


def folder(setting: str) -> pathlib.Path:
    """The folder a setting other than auto / off names, ``~`` expanded. :class:`~jppo.core.errors.InvalidSetting`
    unless it is an absolute path (an empty value, a relative folder or a URI such as ``gs://...`` is not: JAX bounds
    its cache only on a local file system)."""
    path = pathlib.Path(os.path.expanduser(setting))
    if not setting.strip() or not path.is_absolute():
        raise InvalidSetting("trainer.", "compilation_cache", setting, VALID)
    return path


@register_config_check("trainer.compilation_cache")
def check_setting(cfg) -> None:
    """``trainer.compilation_cache``: ``auto``, ``off`` (or one of their spellings) or an absolute local folder the
    run can create (:func:`folder`)."""
    value = cfg.trainer.compilation_cache
    if normalize(value) in (AUTO, OFF):
        return
    with as_key({}, prefix="trainer."):
        folder(value)
    check_local_dir("trainer.compilation_cache", value)


def choose(setting: Optional[str], configured: Optional[str], environ: Mapping[str, str]) -> CacheChoice:
    """The cache ``trainer.compilation_cache = setting`` asks for, given JAX's configured folder (``configured``,
    None when there is none) and the environment."""
    setting = normalize(setting)
    if setting == OFF:
        return CacheChoice(enabled=False)
    if setting == AUTO:
        return CacheChoice(enabled=True) if configured else CacheChoice(True, default_folder(environ))
    return CacheChoice(True, folder(setting))


def apply(setting: Optional[str]) -> Optional[str]:
    """Configures JAX's persistent cache for ``setting`` (before the first compilation); returns the folder in use
    (None: off)."""
    configured = jax.config.jax_compilation_cache_dir
    chosen = choose(setting, configured, os.environ)
    if not chosen.enabled:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    if chosen.folder is None:
        return configured
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(chosen.folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # no size floor either
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    return str(chosen.folder)
