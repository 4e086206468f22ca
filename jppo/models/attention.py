"""Blockwise (flash-style) attention over packed rows in memory linear in the row's length, forward and backward.

The rule is :func:`jppo.models.layers.attention_mask`'s, given by segments and slots instead of a ``[T, S]`` mask:
query ``t`` sees key ``s`` iff ``key_slots[s] <= query_slots[t]`` and ``key_segments[s] == query_segments[t] != 0``.
Queries and keys are described separately, so the queries may be a slice of a row (context parallelism: the
keys and values all-gathered over the ``sequence`` axis, the queries this device's tokens; the slots are then the
tokens' indices in the whole row).

Signature (one call per layer, shapes as in :mod:`jppo.models.layers`)::

    blockwise_attention(query [B, T, H, E], key [B, S, K, E], value [B, S, K, E],
                        query_segments [B, T], key_segments [B, S], query_slots [B, T], key_slots [B, S],
                        block_q=512, block_kv=512) -> [B, T, H, E]

The row is cut into query blocks of ``block_q`` and key blocks of ``block_kv`` tokens (the last padded with
segment 0, which nothing sees). Each query block runs an online softmax over the key blocks: with the running
maximum ``m``, sum ``l`` and unnormalised output ``o``, a key block of scores ``x`` gives ``m' = max(m, max x)``,
``l' = l e^(m - m') + sum e^(x - m')``, ``o' = o e^(m - m') + e^(x - m') v``; the output is ``o / l`` and the
log-sum-exp ``m + log l`` is kept. The backward pass recomputes each block's probabilities ``p = e^(x - lse)``
from it: ``dv = p^T do``, ``ds = p (do v^T - rowsum(do * out))``, ``dq = ds k / sqrt(E)``, ``dk = ds^T q /
sqrt(E)``; no ``[T, S]`` array is stored, only ``O(T)`` residuals (the inputs, the output and the log-sum-exp).
A block pair with no visible (query, key) in any row is skipped (``lax.cond``): under causal masking about half of
them; except on a GPU, where XLA runs a conditional by copying its predicate to the host and waiting for it, once per
block pair: there every pair is computed, the invisible ones adding exact zeros. Masked scores are replaced before the
exponentials and their weights zeroed, as in the reference, so a query with nothing visible (padding) gets exactly 0,
and so do the gradients through it.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jppo.parallel.mesh import platform

Array = jax.Array


class AttentionRule(NamedTuple):
    """Who sees whom, in ``O(T)`` numbers: the queries' and the keys' segments (0: padding) and slots (their
    indices in the row), ``[B, T]`` and ``[B, S]`` integers. :meth:`mask` is the dense ``[B, T, S]`` form."""

    query_segments: Array
    key_segments: Array
    query_slots: Array
    key_slots: Array

    @classmethod
    def packed(cls, segment_ids: Array) -> AttentionRule:
        """Self-attention over whole rows ``[B, T]``: queries and keys are the same tokens, slots ``0 .. T-1``."""
        slots = jnp.broadcast_to(jnp.arange(segment_ids.shape[1], dtype=jnp.int32), segment_ids.shape)
        return cls(segment_ids, segment_ids, slots, slots)

    def mask(self) -> Array:
        """``mask[b, t, s] = (key_slots[b, s] <= query_slots[b, t]) & (key_segments[b, s] == query_segments[b, t]
        != 0)``, the same booleans as :func:`jppo.models.layers.attention_mask`."""
        return _visible(self.query_segments, self.query_slots, self.key_segments, self.key_slots)[:, 0, 0]

DEFAULT_BLOCK_Q = 512  # query tokens per block: [block_q, block_kv] float32 scores per head are the working set
DEFAULT_BLOCK_KV = 512  # key tokens per block; blocks of 512 kept the CPU step as fast as the reference at 4k


def wide(dtype) -> jnp.dtype:
    """The precision of norms, softmax, RoPE and logits for a compute dtype: float32, or float64 for a float64
    model (exactness tests run the whole model in float64)."""
    return jnp.promote_types(dtype, jnp.float32)


_NORMALIZE_BY_PRODUCT = contextvars.ContextVar("jppo_normalize_by_product", default=False)


@contextlib.contextmanager
def normalized_by_product():
    """While a program is traced inside it, attention normalizes by a product with the reciprocal of its sum
    (:func:`softmax`, :func:`normalize`) instead of a division: what ``trainer.deterministic: bitwise`` traces
    with (:mod:`jppo.engine.bitwise`, the bitwise sampler, the run's forward passes)."""
    token = _NORMALIZE_BY_PRODUCT.set(True)
    try:
        yield
    finally:
        _NORMALIZE_BY_PRODUCT.reset(token)


def by_product() -> bool:
    """Whether the program being traced is inside :func:`normalized_by_product`."""
    return _NORMALIZE_BY_PRODUCT.get()


def normalize(values: Array, total: Array) -> Array:
    """``values / total`` (``total`` broadcast over ``values``' trailing axis). Under :func:`normalized_by_product`
    it is ``values * (1 / total)``: XLA rewrites a division by a broadcast into that product in some of its
    pipelines and not in others (a one-device program against one partitioned over several, measured on XLA:CPU),
    and the two differ in the last bit, so a bitwise run writes the product itself and every program computes the
    same bits. Outside it the division stays (the default run's numerics, which the learning corridors hold)."""
    if _NORMALIZE_BY_PRODUCT.get():
        return values * (1.0 / total)
    return values / total


def softmax(scores: Array, axis: int = -1) -> Array:
    """``jax.nn.softmax``, or under :func:`normalized_by_product` ``exp(x - max) * (1 / sum exp(x - max))``
    (:func:`normalize`)."""
    if not _NORMALIZE_BY_PRODUCT.get():
        return jax.nn.softmax(scores, axis=axis)
    top = jax.lax.stop_gradient(jnp.max(scores, axis=axis, keepdims=True))
    weights = jnp.exp(scores - top)
    return normalize(weights, jnp.sum(weights, axis=axis, keepdims=True))


def _visible(query_segments: Array, query_slots: Array, key_segments: Array, key_slots: Array) -> Array:
    """``[B, 1, 1, q, s]``: the attention rule for one query block ``[B, q]`` and one key block ``[B, s]``."""
    same = key_segments[:, None, :] == query_segments[:, :, None]
    causal = key_slots[:, None, :] <= query_slots[:, :, None]
    return (same & causal & (query_segments != 0)[:, :, None])[:, None, None]


def _varying(tree, *sources):
    """``tree`` marked as varying over every manual mesh axis one of ``sources`` varies over. Inside ``shard_map``
    (context parallelism calls this kernel on each shard's slice of the rows) a loop's initial carry must have the
    type its body gives it, and the skipped branch of a block's ``lax.cond`` returns the carry unchanged; outside
    ``shard_map`` nothing varies and ``tree`` is returned as it is."""
    def vma(x) -> frozenset:  # the axes a value varies over: jax 0.10 keeps them in manual_axis_type, later `vma`
        aval = jax.typeof(x)
        kind = getattr(aval, "manual_axis_type", None)
        return kind.varying if kind is not None else getattr(aval, "vma", frozenset())

    axes = frozenset().union(*(vma(x) for x in jax.tree.leaves(sources)))

    def cast(x):
        missing = tuple(sorted(axes - vma(x)))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)


def _scores(query: Array, key: Array, visible: Array, precision) -> Array:
    """Scaled scores ``[B, K, G, q, s]`` of a query block ``[B, K, G, q, E]`` against a key block ``[B, K, s, E]``,
    the invisible ones replaced by the lowest float."""
    scores = jnp.einsum("bkgqe,bkse->bkgqs", query, key, preferred_element_type=precision)
    return jnp.where(visible, scores * (query.shape[-1] ** -0.5), jnp.finfo(precision).min)


def _visit_if(skip: bool, visible: Array, visit, carry):
    """``visit(carry)``, or with ``skip`` the ``carry`` itself when nothing is ``visible`` (one ``lax.cond``).
    Without ``skip`` an invisible block is still computed: every weight of it is 0, so it adds exact zeros (the
    carry's maximum is kept, rescaled by ``e^0 = 1``)."""
    return jax.lax.cond(jnp.any(visible), visit, lambda carry: carry, carry) if skip else visit(carry)


def _forward(query, key, value, query_segments, query_slots, key_segments, key_slots, skip=True):
    """Blocked inputs: ``query [n_q, B, K, G, q, E]``, ``key``/``value [n_kv, B, K, s, E]``, segments and slots
    ``[n, B, q|s]``; ``skip``: see :func:`_visit_if`. Returns the output ``[n_q, B, K, G, q, E]`` (query dtype) and the
    log-sum-exp ``[n_q, B, K, G, q]`` (float32, 0 where nothing is visible)."""
    precision = wide(query.dtype)
    lowest = jnp.finfo(precision).min

    def query_block(_, inputs):
        # one barrier ties the rule to the queries: differentiated inside a scan over layers, partial evaluation
        # would otherwise compute every block's visibility ahead (it depends on known inputs only) and keep all
        # of them, [n_q, n_kv, q, s], as residuals: the very [T, S] memory this avoids
        q, q_segments, q_slots, k_segments, k_slots = jax.lax.optimization_barrier(
            (*inputs, key_segments, key_slots))
        stats = q.shape[:-1]

        def key_block(j, carry):
            visible = _visible(q_segments, q_slots, k_segments[j], k_slots[j])

            def visit(carry):
                top, total, out = carry
                scores = _scores(q, key[j], visible, precision)
                new_top = jnp.maximum(top, scores.max(axis=-1))
                weights = jnp.where(visible, jnp.exp(scores - new_top[..., None]), 0.0)
                rescale = jnp.exp(top - new_top)
                total = total * rescale + weights.sum(axis=-1)
                update = jnp.einsum("bkgqs,bkse->bkgqe", weights.astype(value.dtype), value[j],
                                    preferred_element_type=precision)
                return new_top, total, out * rescale[..., None] + update

            return _visit_if(skip, visible, visit, carry)

        init = (jnp.full(stats, lowest, precision), jnp.zeros(stats, precision), jnp.zeros(q.shape, precision))
        init = _varying(init, q, key, value, q_segments, q_slots, k_segments, k_slots)
        top, total, out = jax.lax.fori_loop(0, key.shape[0], key_block, init)
        seen = total > 0
        out = normalize(out, jnp.where(seen, total, 1.0)[..., None])
        return None, (out.astype(query.dtype), jnp.where(seen, top + jnp.log(jnp.where(seen, total, 1.0)), 0.0))

    _, (out, lse) = jax.lax.scan(query_block, None, (query, query_segments, query_slots))
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _blocked_attention(query, key, value, query_segments, query_slots, key_segments, key_slots, skip):
    return _forward(query, key, value, query_segments, query_slots, key_segments, key_slots, skip)[0]


def _blocked_attention_fwd(query, key, value, query_segments, query_slots, key_segments, key_slots, skip):
    inputs = (query, key, value, query_segments, query_slots, key_segments, key_slots)
    # the VJP is _blocked_attention_bwd's; under a scan over layers JAX still linearizes this rule's loops (their
    # every step's carry then kept for nothing, [n_q, n_kv, ...]) unless told that no derivative flows through them
    out, lse = _forward(*(jax.lax.stop_gradient(x) for x in inputs), skip)
    return out, (*inputs, out, lse)


def _blocked_attention_bwd(skip, residuals, d_out):
    query, key, value, query_segments, query_slots, key_segments, key_slots, out, lse = residuals
    precision = wide(query.dtype)
    scale = query.shape[-1] ** -0.5
    delta = jnp.sum(d_out.astype(precision) * out.astype(precision), axis=-1)  # rowsum(do * out) [n_q, B, K, G, q]

    def key_block(d_query, inputs):
        # the barrier ties every residual to the cotangent: transposing a scan over layers, JAX hoists what does
        # not depend on the cotangent (each block's probabilities) out of the loop and would keep them all
        k, v, k_segments, k_slots, q_segments, q_slots, queries, lses, d_outs, deltas = jax.lax.optimization_barrier(
            (*inputs, query_segments, query_slots, query, lse, d_out, delta))

        def query_block(i, carry):
            visible = _visible(q_segments[i], q_slots[i], k_segments, k_slots)

            def visit(carry):
                d_query, d_key, d_value = carry
                q, d_o = queries[i], d_outs[i]
                scores = _scores(q, k, visible, precision)
                probs = jnp.where(visible, jnp.exp(scores - lses[i][..., None]), 0.0)
                d_value = d_value + jnp.einsum("bkgqs,bkgqe->bkse", probs.astype(d_o.dtype), d_o,
                                               preferred_element_type=precision)
                d_probs = jnp.einsum("bkgqe,bkse->bkgqs", d_o, v, preferred_element_type=precision)
                d_scores = probs * (d_probs - deltas[i][..., None]) * scale
                d_q = jnp.einsum("bkgqs,bkse->bkgqe", d_scores.astype(k.dtype), k, preferred_element_type=precision)
                d_key = d_key + jnp.einsum("bkgqs,bkgqe->bkse", d_scores.astype(q.dtype), q,
                                           preferred_element_type=precision)
                return d_query.at[i].add(d_q), d_key, d_value

            return _visit_if(skip, visible, visit, carry)

        zeros = jnp.zeros(k.shape, precision)
        init = _varying((d_query, zeros, zeros), inputs, q_segments, q_slots, queries, lses, d_outs, deltas)
        d_query, d_key, d_value = jax.lax.fori_loop(0, query.shape[0], query_block, init)
        return d_query, (d_key.astype(key.dtype), d_value.astype(value.dtype))

    d_query = _varying(jnp.zeros(query.shape, precision), residuals, d_out)
    d_query, (d_key, d_value) = jax.lax.scan(key_block, d_query, (key, value, key_segments, key_slots))
    return d_query.astype(query.dtype), d_key, d_value, None, None, None, None


_blocked_attention.defvjp(_blocked_attention_fwd, _blocked_attention_bwd)


def block_size(block: int, length: int) -> int:
    """The block used for ``length`` tokens: ``block``, or the whole row when it is shorter (no padding then)."""
    if block < 1:
        raise ValueError(f"attention block size {block} is invalid: it must be an integer >= 1")
    return min(block, length)


def _blocks(x: Array, block: int, fill=0) -> Array:
    """``x [B, T, ...]`` padded to a multiple of ``block`` along ``T`` and split: ``[T / block, B, block, ...]``."""
    batch, length = x.shape[:2]
    pad = -length % block
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
    return jnp.moveaxis(x.reshape(batch, (length + pad) // block, block, *x.shape[2:]), 1, 0)


def blockwise_attention(
    query: Array, key: Array, value: Array, query_segments: Array, key_segments: Array, query_slots: Array,
    key_slots: Array, block_q: int = DEFAULT_BLOCK_Q, block_kv: int = DEFAULT_BLOCK_KV, skip: bool | None = None,
) -> Array:
    """Grouped-query attention ``softmax(q k^T / sqrt(E) | rule) v`` (the rule in the module's docstring) in
    blocks of ``block_q`` queries and ``block_kv`` keys: ``query [B, T, H, E]``, ``key``/``value [B, S, K, E]``
    (query head ``h`` reads key head ``h // (H/K)``), integer segments and slots ``[B, T]`` / ``[B, S]``.
    Returns ``[B, T, H, E]`` in the query's dtype; scores, softmax and accumulations in float32 (float64 for a
    float64 query). ``skip``: whether a block pair nothing sees is skipped by a conditional (default: except on a
    GPU, :func:`~jppo.parallel.mesh.platform`; the same numbers either way)."""
    batch, length, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[2]
    group = num_heads // num_kv_heads
    block_q, block_kv = block_size(block_q, length), block_size(block_kv, key.shape[1])
    # heads before tokens: every block product is then a plain batched matmul over (row, kv head)
    grouped = query.reshape(batch, length, num_kv_heads, group, head_dim)
    q = _blocks(grouped, block_q).transpose(0, 1, 3, 4, 2, 5)  # [n_q, B, K, G, q, E]
    k, v = (_blocks(x, block_kv).transpose(0, 1, 3, 2, 4) for x in (key, value))  # [n_kv, B, K, s, E]
    q_segments, k_segments = _blocks(query_segments, block_q), _blocks(key_segments, block_kv)
    q_slots, k_slots = _blocks(query_slots, block_q), _blocks(key_slots, block_kv)
    skip = platform() != "gpu" if skip is None else skip
    out = _blocked_attention(q, k, v, q_segments, q_slots, k_segments, k_slots, skip)  # [n_q, B, K, G, q, E]
    out = out.transpose(1, 0, 4, 2, 3, 5).reshape(batch, -1, num_heads, head_dim)
    return out[:, :length]
