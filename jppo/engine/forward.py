"""Forward-only passes over a whole rollout batch, in micro-batches: old and reference log-probs, values.

The same micro-batch layout as the updates (fixed or token-budget, see :mod:`jppo.engine.microbatch`); ``lax.map`` runs
the micro-batches one after another inside one compiled call, so peak memory is that of one micro-batch.
The micro-batches are assembled on the devices from the batch's rows (:mod:`jppo.engine.assemble`), and the
outputs are put back in the batch's row order there: they come back response-aligned, ``[N, L]``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jppo.core.experience import Experience
from jppo.engine.assemble import assemble, device_rows, place_cut
from jppo.engine.microbatch import cut_micro_batches, pad_cut
from jppo.engine.objectives import Batch, policy_outputs, value_outputs
from jppo.models.attention import normalized_by_product
from jppo.parallel.hostlocal import local_rows, local_shards, max_over_processes, to_local
from jppo.parallel.mesh import ROW_AXES, batch_shards


def _per_micro_batch(fn: Callable[[nnx.Module, Batch], jax.Array], graphdef: nnx.GraphDef):
    def run(params: nnx.State, batch: Batch) -> jax.Array:
        model = nnx.merge(graphdef, params)

        def one(micro: Batch) -> jax.Array:
            d, s, length = micro.gather_index.shape
            return fn(model, micro).reshape(d, s, length)

        return jax.lax.map(one, batch)

    return jax.jit(run)


def log_prob_fn(graphdef: nnx.GraphDef, *, temperature: float, chunk_size: int):
    """Jitted ``(params, micro_batches) -> log-probs [K, D, S, L]`` of the response tokens."""
    return _per_micro_batch(
        lambda model, micro: policy_outputs(
            model, micro, temperature=temperature, chunk_size=chunk_size, with_entropy=False
        )[0],
        graphdef,
    )


def value_fn(graphdef: nnx.GraphDef):
    """Jitted ``(params, micro_batches) -> values [K, D, S, L]`` before each response token."""
    return _per_micro_batch(value_outputs, graphdef)


def reward_model_fn(graphdef: nnx.GraphDef):
    """Jitted ``(params, micro_batches) -> [K, D, S, L]``: a value-head model's output AT each response token
    (one position later than :func:`value_fn`), so the entry of the last token scores the whole sequence."""

    def after_each_token(model: nnx.Module, micro: Batch) -> jax.Array:
        shifted = dataclasses.replace(micro, gather_index=micro.gather_index + 1)
        return value_outputs(model, shifted)

    return _per_micro_batch(after_each_token, graphdef)


def forward_batch(
    fn,
    params: nnx.State,
    batch: Experience,
    mesh: Mesh,
    *,
    micro_batch_size: int | None = None,
    max_token_len: int | None = None,
    rows: Experience | None = None,
    bitwise: bool = False,
) -> np.ndarray:
    """Runs a forward pass from :func:`log_prob_fn` / :func:`value_fn` over ``batch`` (this process's rows);
    returns ``[N_local, L]`` float32, 0 outside the response mask.

    ``rows``: ``batch``'s token arrays already on the devices (:func:`jppo.engine.assemble.device_rows` with no
    per-token fields), shared by several passes over the same batch; placed here when not given. Only the cut
    (row ids and offsets) crosses per pass; the micro-batches are assembled on the devices, and the outputs are put
    back in row order there, so what comes back is ``[N_local, L]``, not the slots. ``bitwise``
    (``trainer.deterministic``, with one sequence per shard per pass): traced with attention normalized by products
    (:func:`jppo.models.attention.normalized_by_product`), so a row's outputs have the same bits on any mesh."""
    if rows is None:
        rows = device_rows(batch, None, mesh)
    num_global = batch.num_sequences * batch_shards(mesh) // len(local_shards(mesh))
    cut = local_cut(batch.lengths(), mesh, micro_batch_size=micro_batch_size, max_token_len=max_token_len)
    cut = place_cut(cut, mesh)
    if bitwise:  # whole weights on every device, as in the bitwise update: no product's sum split over fsdp
        params = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
    with jax.set_mesh(mesh), normalized_by_product() if bitwise else contextlib.nullcontext():
        slots = fn(params, assemble(rows, cut, mesh, max_token_len))
        out = _in_row_order(mesh, num_global)(slots, cut["row_ids"])
    out = to_local(out, rows=local_rows(mesh, num_global))
    return np.where(batch.response_mask.astype(bool), out, 0.0).astype(np.float32)


def local_cut(lengths: np.ndarray, mesh: Mesh, **sizes) -> tuple[np.ndarray, np.ndarray]:
    """The cut of this process's rows (:func:`jppo.engine.microbatch.cut_micro_batches` over its own shards), K and S
    padded to their largest over the processes, its slots naming GLOBAL rows."""
    owned = local_shards(mesh)
    row_ids, offsets = cut_micro_batches(lengths, len(owned), **sizes)
    k, s = max_over_processes([row_ids.shape[0], row_ids.shape[2]])
    start = local_rows(mesh, len(lengths) * batch_shards(mesh) // len(owned)).start
    row_ids = np.where(row_ids >= 0, row_ids + start, -1).astype(np.int32)
    return pad_cut(row_ids, offsets, int(k), int(s))


@functools.lru_cache(maxsize=16)
def _in_row_order(mesh: Mesh, num_rows: int):
    """Jitted ``(slots [K, D, S, L], row_ids [K, D, S]) -> [num_rows, L]``: each slot's outputs written to its
    global row (empty slots dropped), sharded over the row axes like the rows."""

    def scatter(slots, row_ids):
        flat = row_ids.reshape(-1)
        values = slots.reshape(flat.shape[0], slots.shape[-1])
        target = jnp.where(flat >= 0, flat, num_rows)  # out of range: dropped
        return jnp.zeros((num_rows, slots.shape[-1]), slots.dtype).at[target].set(values, mode="drop")

    return jax.jit(scatter, out_shardings=NamedSharding(mesh, PartitionSpec(ROW_AXES)))
