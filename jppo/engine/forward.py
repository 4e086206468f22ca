"""Forward-only passes over a whole rollout batch, in micro-batches: old and reference log-probs, values.

The same micro-batch layout as the updates (fixed or token-budget, see :mod:`jppo.microbatch`); ``lax.map`` runs
the micro-batches one after another inside one compiled call, so peak memory is that of one micro-batch.
Outputs come back response-aligned, ``[N, L]`` in the batch's own row order.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jppo.engine.layout import place
from jppo.engine.update import Batch, policy_outputs, value_outputs
from jppo.hostlocal import local_shards, max_over_processes, to_local
from jppo.experience import Experience
from jppo.microbatch import make_micro_batches, pad_micro_batches, scatter_back


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
) -> np.ndarray:
    """Runs a forward pass from :func:`log_prob_fn` / :func:`value_fn` over ``batch`` (this process's rows);
    returns ``[N_local, L]`` float32, 0 outside the response mask."""
    owned = local_shards(mesh)
    micro = make_micro_batches(batch, len(owned), micro_batch_size=micro_batch_size, max_token_len=max_token_len)
    k, s = max_over_processes([micro.input_ids.shape[0], micro.row_ids.shape[2]])
    micro = pad_micro_batches(micro, int(k), int(s))
    with jax.set_mesh(mesh):
        slots = fn(params, place(micro.token_rows(), mesh))
    out = scatter_back(to_local(slots, axis=1, rows=owned), micro.row_ids, batch.num_sequences)
    return np.where(batch.response_mask.astype(bool), out, 0.0).astype(np.float32)
