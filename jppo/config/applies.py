"""Where each key applies (placeholder)."""

from __future__ import annotations


def check_engine_keys(cfg) -> None:
    return None
