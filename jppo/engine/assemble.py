"""Micro-batches assembled on the devices, from batch rows that crossed to them once.

The host decides a cut from the sequences' lengths alone (:func:`jppo.engine.microbatch.cut_micro_batches`: which
sequence sits in each slot, and at which column of its token row it starts); :func:`assemble` builds from that cut
and the rows already on the devices exactly the arrays :func:`jppo.engine.microbatch.make_micro_batches` builds on the
host. So a batch's tokens and per-token fields cross to the devices once per use (:func:`device_rows`), and every
further cut of the same rows (another epoch, another mini-batch order, another forward pass) costs its cut, two
int32 arrays of one entry per slot, instead of a re-cut copy of the rows.

The rows are sharded over the row axes like any batch; the cut's slots name global rows, so a slot on shard d
may read a row held by another shard (or host): the gather runs inside one jitted program, where XLA moves rows
between the devices, never through a host.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jppo.core.experience import Experience
from jppo.engine.layout import place
from jppo.engine.microbatch import MicroBatches, fixed_gather_index
from jppo.parallel.mesh import ROW_AXES

Cut = tuple[np.ndarray, np.ndarray]  # row_ids, offsets: [..., D, S] each


def host_rows(batch: Experience, per_token: tuple[str, ...] | None) -> Experience:
    """What :func:`device_rows` sends: the token arrays (ids as int32, masks as bool, as the token rows hold them)
    and the per-token fields ``per_token`` plus the response mask, nothing else; ``per_token`` None: the token
    arrays alone (what a forward pass reads)."""
    kept = batch.keep_per_token(per_token or ())  # no row fields: the devices never read them
    if per_token is None:
        kept = dataclasses.replace(kept, response_mask=None)
    return dataclasses.replace(
        kept,
        prompt_ids=np.asarray(kept.prompt_ids, np.int32), response_ids=np.asarray(kept.response_ids, np.int32),
        prompt_mask=np.asarray(kept.prompt_mask, bool), response_attention=np.asarray(kept.response_attention, bool),
    )


def device_rows(batch: Experience, per_token: tuple[str, ...] | None, mesh: Mesh) -> Experience:
    """This process's rows of :func:`host_rows` as global arrays ``[N, ...]`` sharded over the row axes."""
    return place(host_rows(batch, per_token), mesh, scanned=0)


def assemble_rows(rows: Experience, row_ids: jax.Array, offsets: jax.Array, width: int | None) -> MicroBatches:
    """The micro-batches of cut ``(row_ids, offsets)`` (``[..., S]``, -1: empty slot) over ``rows``: token rows
    ``[..., R, W]`` and slots ``[..., S, L]`` (every per-token field ``rows`` carries besides its tokens).

    ``width`` None: the fixed layout (one sequence per row, ``R = S``, ``W = P + L``, the rollout's own columns).
    Otherwise the packed layout (``R = 1``, ``W = width``): the real tokens of slot s (prompt without its left
    padding, then the existing response tokens) start at column ``offsets[s]``, positions restart at 0, segment id
    s + 1. Empty slots and unused columns hold zeros, as on the host. Rows with ``routed_experts`` (routing replay)
    give each token of the token rows its recorded experts ``[..., R, W, Ls, k]`` the same way (other columns: not
    recorded)."""
    body = functools.partial(_one_token_row, rows, width=width)
    for _ in range(row_ids.ndim - 1):
        body = jax.vmap(body)
    return body(row_ids, offsets)


def _one_token_row(rows: Experience, row_ids: jax.Array, offsets: jax.Array, *, width: int | None) -> MicroBatches:
    """One shard's micro-batch: slots ``[S]`` -> token rows ``[R, W]``, gather index and slots ``[S, L]``."""
    num_slots = row_ids.shape[0]
    p, length = rows.prompt_ids.shape[1], rows.response_ids.shape[1]
    present = row_ids >= 0
    safe = jnp.where(present, row_ids, 0)
    ids = jnp.concatenate([rows.prompt_ids[safe], rows.response_ids[safe]], axis=1)  # [S, P + L]
    real = jnp.concatenate([rows.prompt_mask[safe], rows.response_attention[safe]], axis=1) & present[:, None]
    if width is None:
        gather = jnp.where(present[:, None], jnp.asarray(fixed_gather_index(num_slots, p, length)), 0)
        token_rows = dict(
            input_ids=jnp.where(real, ids, 0).astype(jnp.int32),
            positions=jnp.maximum(jnp.cumsum(real, axis=1) - 1, 0).astype(jnp.int32),
            segment_ids=real.astype(jnp.int32),
        )
        routed = _routed(rows, safe, lambda r, none: jnp.where(real[:, :, None, None], r, none))
    else:
        prompt_len = jnp.sum(rows.prompt_mask[safe], axis=1, dtype=jnp.int32)
        response_len = jnp.sum(rows.response_attention[safe], axis=1, dtype=jnp.int32)
        # column c of the rollout layout is token c - (P - prompt_len) of its sequence (the prompt is left-padded)
        position = jnp.arange(p + length, dtype=jnp.int32)[None, :] - (p - prompt_len)[:, None]
        target = jnp.where(real, offsets[:, None] + position, width)  # width: out of the row, dropped
        segment = jnp.broadcast_to(jnp.arange(1, num_slots + 1, dtype=jnp.int32)[:, None], real.shape)

        def scatter(values):
            return jnp.zeros((1, width), jnp.int32).at[0, target].set(values.astype(jnp.int32), mode="drop")

        token_rows = dict(input_ids=scatter(ids), positions=scatter(position), segment_ids=scatter(segment))
        routed = _routed(rows, safe, lambda r, none: jnp.full((1, width) + r.shape[2:], none, r.dtype)
                         .at[0, target].set(r, mode="drop"))
        column = jnp.arange(length, dtype=jnp.int32)[None, :]
        exists = present[:, None] & (column < response_len[:, None])
        gather = jnp.where(exists, offsets[:, None] + prompt_len[:, None] - 1 + column, 0)
    return MicroBatches(**token_rows, gather_index=gather.astype(jnp.int32), slots=_slots(rows, safe, present),
                        row_ids=None, routed_experts=routed)


def _routed(rows: Experience, safe: jax.Array, place) -> jax.Array | None:
    """The slots' recorded experts ``[S, P + L, Ls, k]`` placed on the token rows by ``place(record, not
    recorded)``; None without a record."""
    if rows.routed_experts is None:
        return None
    record = rows.routed_experts[safe]
    return place(record, jnp.asarray(jnp.iinfo(record.dtype).max, record.dtype))


def _slots(rows: Experience, safe: jax.Array, present: jax.Array) -> Experience | None:
    fields = rows.per_token()
    if fields.response_mask is None:  # token rows only (forward passes)
        return None
    slots = jax.tree.map(lambda v: jnp.where(present[:, None], v[safe], 0).astype(v.dtype), fields)
    return dataclasses.replace(slots, response_mask=slots.response_mask.astype(bool))


@functools.lru_cache(maxsize=32)
def _assembler(mesh: Mesh, width: int | None, scanned: int):
    sharding = NamedSharding(mesh, PartitionSpec(*([None] * scanned), ROW_AXES))
    return jax.jit(functools.partial(assemble_rows, width=width), out_shardings=sharding)


def place_cut(cut: Cut, mesh: Mesh) -> dict[str, jax.Array]:
    """This process's part of a cut (``[..., D_local, S]``: its own shards' slots, naming global rows) as global
    arrays ``row_ids`` and ``offsets``, sharded over the row axes."""
    return place({"row_ids": cut[0], "offsets": cut[1]}, mesh, scanned=cut[0].ndim - 2)


def assemble(rows: Experience, cut: Cut | dict[str, jax.Array], mesh: Mesh, width: int | None) -> MicroBatches:
    """:func:`assemble_rows` of a cut (host arrays, or already placed by :func:`place_cut`), as global
    micro-batch arrays sharded over the row axes like :func:`jppo.engine.layout.place`'s."""
    placed = place_cut(cut, mesh) if isinstance(cut, tuple) else cut
    with jax.set_mesh(mesh):
        scanned = placed["row_ids"].ndim - 2
        return _assembler(mesh, width, scanned)(rows, placed["row_ids"], placed["offsets"])
