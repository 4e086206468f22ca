"""Model sources named by Hugging Face repo id, found in the local Hugging Face cache only (never downloaded).

A model or tokenizer setting (``model.path``, ``critic.model_path``, ...) is either a local directory or a repo id
such as ``Qwen/Qwen2.5-0.5B-Instruct``. :func:`local_model_dir` turns it into the directory to read: an existing
local directory always wins; otherwise a repo id is looked up with ``huggingface_hub.snapshot_download(...,
local_files_only=True)`` in the cache that ``hf download`` fills (``HF_HUB_CACHE``, else
``HF_HOME/hub``, read when called), which returns the snapshot folder ``models--Org--Name/snapshots/<commit>/``
that ``refs/main`` points at. A run never reaches the network for a model: an uncached id is a config error.
"""

from __future__ import annotations

import os
import re

from jppo.core.errors import ConfigError

# ``name`` or ``namespace/name`` (the Hub's own rule: letters, digits, ``-``, ``_``, ``.``; no ``--``/``..``).
_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*$")


def hub_cache_dir() -> str:
    """The local Hugging Face hub cache, as huggingface_hub resolves it, but read from the environment now."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return os.path.expanduser(os.path.expandvars(explicit))
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    home = os.environ.get("HF_HOME") or os.path.join(xdg, "huggingface")
    return os.path.join(os.path.expanduser(os.path.expandvars(home)), "hub")


def is_repo_id(value: str) -> bool:
    return bool(_REPO_ID.match(value)) and "--" not in value and ".." not in value


def local_model_dir(key: str, value: str) -> str:
    """The local directory that config key ``key``'s ``value`` names: the directory itself, or the cached snapshot
    of the repo id ``value``. A value that is neither a directory nor a repo id comes back unchanged (the caller
    reports what is missing there); a repo id absent from the cache is a one-line :class:`ConfigError`."""
    if os.path.isdir(os.path.expanduser(value)) or not is_repo_id(value):
        return value
    from huggingface_hub import snapshot_download  # noqa: PLC0415 (only when a repo id is given)
    from huggingface_hub.errors import LocalEntryNotFoundError  # noqa: PLC0415

    cache = hub_cache_dir()
    try:
        return snapshot_download(value, cache_dir=cache, local_files_only=True)
    except (LocalEntryNotFoundError, ValueError):
        raise ConfigError(
            f"{key}={value!r}: no such local directory, and Hugging Face repo {value!r} is not in the local Hugging "
            f"Face cache ({cache}; set HF_HUB_CACHE or HF_HOME to use another); fetch it first with "
            f"`hf download {value}` (jppo never downloads)"
        ) from None
