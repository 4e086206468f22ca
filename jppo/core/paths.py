"""Where a run writes: one path type for local folders and Cloud Storage URIs (``gs://bucket/run``).

Every run output (``trainer.output_dir`` and what lies under it: checkpoints, ``metrics.jsonl``, ``config.yaml``,
TensorBoard events, plots, the Hugging Face export) goes through :func:`run_path`, an ``etils.epath.Path``, the
path type orbax itself uses. A local path behaves as ``pathlib`` would (made absolute, so a later ``chdir`` does not
move the run); a URI stays a URI: ``pathlib.Path("gs://bucket/run")`` would be the local folder ``gs:/bucket/run``
(and ``.absolute()`` on an epath URI does the same), so URIs are never made absolute here.

Object stores cannot append to or rename an object; :func:`is_remote` tells writers which kind they have.
"""

from __future__ import annotations

import os

from etils import epath

# Schemes a run may write to: epath reads and writes them, and so does orbax's array writer (tensorstore).
REMOTE_SCHEMES = ("gs",)


def scheme(value: str | os.PathLike) -> str | None:
    """The URI scheme of ``value`` (``"gs"`` for ``gs://bucket/run``), or ``None`` for a local path."""
    text = os.fspath(value)
    head, separator, _ = text.partition("://")
    return head if separator and head.isidentifier() else None


def is_remote(value: str | os.PathLike) -> bool:
    """True for a cloud URI (any ``scheme://``), False for a local path."""
    return scheme(value) is not None


def run_path(value: str | os.PathLike) -> epath.Path:
    """``value`` as an ``epath.Path``: a URI as it is, a local path made absolute (nothing is created)."""
    path = epath.Path(value)
    return path if is_remote(value) else path.absolute()


# The package epath reads each scheme through when TensorFlow's file system is absent (fsspec's implementations).
_FSSPEC_PACKAGES = {"gs": "gcsfs"}


def missing_backend(value: str | os.PathLike) -> str | None:
    """Why ``value`` cannot be written here, in a few words, or ``None`` when it can (checks imports, no I/O)."""
    name = scheme(value)
    if name is None:
        return None
    if name not in REMOTE_SCHEMES:
        return f"unsupported URI scheme {name}:// (supported: {', '.join(s + '://' for s in REMOTE_SCHEMES)})"
    from importlib.util import find_spec  # noqa: PLC0415

    package = _FSSPEC_PACKAGES[name]
    if find_spec(package) is None and not (name == "gs" and find_spec("tensorflow") is not None):
        return f"{name}:// needs the {package} package (pip install {package})"
    return None
