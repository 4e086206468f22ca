"""Micro-batch arrays on the mesh, and the gather from token rows to sequence slots.

Every array of a :class:`jppo.engine.microbatch.MicroBatches` is ``[K, D, ...]`` (or ``[M, K, D, ...]`` for M optimizer
steps): K micro-batches (scanned over inside one compiled step) and D batch shards (sharded over the batch axes
``data`` x ``fsdp``). Slicing micro-batch k therefore takes the k-th block of every shard's own rows: nothing
moves between devices.
"""

from __future__ import annotations

from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jppo.parallel.hostlocal import to_global

T = TypeVar("T")


def place(arrays: T, mesh: Mesh, scanned: int = 1) -> T:
    """Global arrays from this process's micro-batch arrays, any pytree of them (``scanned`` leading axes, then
    its D_local shards)."""
    return jax.tree.map(lambda array: to_global(np.asarray(array), mesh, scanned), arrays)


def flatten_shards(x: jax.Array) -> jax.Array:
    """``[D, R, ...] -> [D * R, ...]``: the model sees one batch of rows."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def next_token_targets(input_ids: jax.Array) -> jax.Array:
    """Target of position t is the token at t + 1 (0 for the last position, which no slot gathers)."""
    return jnp.pad(input_ids[:, 1:], ((0, 0), (0, 1)))


def gather_slots(per_token: jax.Array, gather_index: jax.Array) -> jax.Array:
    """Per-token model outputs of token rows ``[D * R, W]`` -> response-aligned slots ``[D * S, L]``.

    The gather runs along each shard's own rows (batched over D), so it stays on the device that holds them.
    """
    d, s, length = gather_index.shape
    rows = per_token.reshape(d, -1)
    picked = jnp.take_along_axis(rows, gather_index.reshape(d, s * length), axis=1)
    return picked.reshape(d * s, length)
