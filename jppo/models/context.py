"""Context parallelism: attention of packed rows whose tokens are split over the ``sequence`` mesh axis.

The decoder's activations ``[B, T, D]`` are split along ``T`` in ``s`` contiguous blocks by the rule table
(logical ``length`` -> mesh ``sequence``); everything but attention is per token and needs no communication.
Attention needs every earlier key of a query's row: each shard keeps its ``T / s`` queries and all-gathers the keys
and values of the whole row along the axis, then runs the decoder's own :func:`~jppo.models.layers.attention` with
the mask of its queries' global slots::

    mask[b, t, j] = (j <= s_index * T / s + t) & (segments[b, j] == query_segments[b, t] != 0)

which is the single-device mask's rows of that block, so every output (and, through the all-gather's transpose, a
reduce-scatter, every gradient) is the single-device one up to summation order.

Why an all-gather and not a ring of ``ppermute``: under grouped-query attention the keys and values are few (Qwen2.5
0.5B: 2 key-value heads of 64 against 14 query heads, 256 numbers per token and layer against the hidden state's
896), so gathering them whole costs ``(s - 1) / s`` of one layer's keys and values in one collective XLA can overlap
with the projections, the same bytes a ring passes around in ``s - 1`` steps, with no per-step softmax merge;
a ring only wins where a row's gathered keys and values do not fit, 16 MiB per layer for 32k bfloat16 tokens here.

Causal work is not re-balanced (no zigzag assignment): the dense attention computes every shard's ``[T / s, T]``
scores whether masked or not, so each shard does the same work. A blockwise kernel that skips masked blocks would
make the last shard the slowest; zigzag then is a permutation of the tokens before the model and explicit key slots
here (``query_slots``/``key_slots`` of the mask), the join point :func:`sequence_attention` keeps small.

The rotary positions are each token's position in its packed row (the packing's explicit ``positions``, split like
the tokens), and the next-token targets are taken from the whole row before it is split
(:func:`jppo.engine.layout.next_token_targets`), so nothing else changes at a shard's boundary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jppo.models.attention import AttentionRule
from jppo.models.layers import attention, resolve_attention
from jppo.parallel.mesh import SEQUENCE_AXIS, fitted_spec, platform, sequence_shards

Array = jax.Array


def sequence_shards_of(length: int) -> int:
    """Into how many blocks rows of ``length`` tokens are split over the ``sequence`` axis of the mesh set at trace
    time: the axis' size where it divides them, else 1 (the rule table leaves the tokens whole)."""
    mesh = jax.sharding.get_abstract_mesh()
    shards = 1 if mesh.empty else sequence_shards(dict(mesh.shape))
    return shards if length % shards == 0 else 1


def context_parallel(length: int) -> bool:
    """Whether rows of ``length`` tokens are split over the ``sequence`` axis (:func:`sequence_shards_of` > 1)."""
    return sequence_shards_of(length) > 1


def sequence_attention(
    query: Array, key: Array, value: Array, segment_ids: Array, implementation: str, blocks: tuple[int, int],
) -> Array:
    """:func:`~jppo.models.layers.attention` of ``query [B, T, H, E]`` over ``key``/``value [B, T, K, E]`` in the
    packed rows of ``segment_ids [B, T]``, the tokens split over the ``sequence`` axis: each shard's queries
    attend over the all-gathered keys and values of their rows (module docstring), by the :class:`AttentionRule`
    of their global slots, so every implementation that takes a rule (``blockwise`` in ``blocks``) works on the
    slice; ``pallas``, whose kernels take whole rows only, runs ``blockwise`` here. Call it under the mesh
    (``jax.set_mesh``) when :func:`context_parallel` holds."""
    mesh = jax.sharding.get_abstract_mesh()
    shape = dict(mesh.shape)
    # heads stay split over `tensor` only when both counts divide: a query head must find its key-value head locally
    heads = all(
        fitted_spec((n,), (name,), shape)[0] is not None
        for n, name in ((query.shape[2], "q_heads"), (key.shape[2], "kv_heads"))
    )
    q_spec = fitted_spec(query.shape, ("batch", "length", "q_heads" if heads else None, None), shape)
    kv_spec = fitted_spec(key.shape, ("batch", "length", "kv_heads" if heads else None, None), shape)
    rows = fitted_spec(segment_ids.shape, ("batch", None), shape)[0]

    def local(q, k, v, query_segments, key_segments):
        block = q.shape[1]
        k, v = (jax.lax.all_gather(x, SEQUENCE_AXIS, axis=1, tiled=True) for x in (k, v))
        slots = lambda first, n: jnp.broadcast_to(first + jnp.arange(n, dtype=jnp.int32), (q.shape[0], n))  # noqa: E731
        rule = AttentionRule(query_segments, key_segments, slots(jax.lax.axis_index(SEQUENCE_AXIS) * block, block),
                             slots(0, k.shape[1]))
        chosen = resolve_attention(implementation, q.dtype, platform(), k.shape[1])
        return attention(q, k, v, rule, "blockwise" if chosen == "pallas" else chosen, blocks)

    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(q_spec, kv_spec, kv_spec, PartitionSpec(rows, SEQUENCE_AXIS), PartitionSpec(rows, None)),
        out_specs=q_spec,
    )(query, key, value, segment_ids, segment_ids)
