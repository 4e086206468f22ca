"""The decoder's bitwise path (``trainer.deterministic: bitwise``): a token's numbers have the same bits whether the
trainer computes them over a whole row or the sampler one decoding step at a time.

XLA:CPU gives a row of a matrix product bits that depend on the product's shape (``M = 1`` and ``M = 2`` rows
differ) but not on what the other rows hold, and it folds a reduction's terms in order. So, traced under
:func:`~jppo.models.attention.normalized_by_product`:

- every per-token part of a layer (norms, projections, rotary positions, the output projection, the MLP) and the
  head with its log-softmax runs over fixed chunks of :data:`CHUNK` tokens, one chunk after another
  (:func:`over_tokens`): in the trainer ``CHUNK`` consecutive tokens of one row, in the sampler ``CHUNK`` rows'
  new tokens. Every product then has ``M = CHUNK`` rows, wherever the token is;
- attention computes each query alone (:func:`attend_each`): its scores, softmax and weighted values are
  elementwise products and sums over the row's whole width ``S`` (prompt columns, then response columns) in
  column order: no matrix product, no key blocks. The keys a query cannot see add exact zeros, so a query gets the
  same bits from the trainer's row (``S = P + L``, every later token present but invisible) and from the sampler's
  cache (the same ``S`` columns, those not yet written zero).

:func:`forward` is the trainer's pass over rows (and the sampler's prefill, its keys padded to the row's width);
:func:`decode_step` is one new token per row over a cache ``[L, R, S, K, E]`` of the rows' keys and values.

The price, against the default path: the rows' tokens go through the layers ``CHUNK`` at a time (no wider
products), attention's ``T x S x H x E`` products are elementwise (no blocks skipped), and the sampler reads every
column of its cache at every step.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from jppo.models.layers import dense, rms_norm, rope_tables, wide
from jppo.models.moe import (
    flat_replay,
    layer_slices,
    record_router_stats,
    record_routing,
    route,
    router_stats,
    stack_layers,
)

Array = jax.Array

CHUNK = 8  # tokens per product: XLA:CPU gives a row the same bits in any product of 8 rows (not of 1 and of 2)


def over_tokens(fn: Callable, *arrays: Array, summed: bool = False):
    """``fn`` over fixed chunks of :data:`CHUNK` tokens of ``arrays [B, T, ...]`` (axis 1, padded with zeros to a
    multiple), one chunk after another (``lax.map``); its outputs ``[B, CHUNK, ...]`` come back ``[B, T, ...]``.
    ``summed``: ``fn`` returns ``(outputs, sums)``, and the chunks' ``sums`` come back added over the chunks in
    order (a layer with experts' router statistics).

    Each chunk runs under ``jax.checkpoint``: differentiated (the update), the forward pass then computes the
    primal operations alone and the backward pass recomputes them, so the update's log-probs are the forward
    pass's bits (first micro-step's ratio exactly 1). Without it XLA fused the saved intermediates differently and
    2 of 760 log-probs moved by 1e-6 (the GSM8K-like shape). A loop, not unrolled: unrolled, XLA merged the chunks'
    products and 309 of the 760 moved."""
    length = arrays[0].shape[1]
    chunks = -(-length // CHUNK)

    def split(x: Array) -> Array:  # [B, T, ...] -> [chunks, B, CHUNK, ...]
        x = jnp.pad(x, [(0, 0), (0, chunks * CHUNK - length)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(x.shape[0], chunks, CHUNK, *x.shape[2:]), 1, 0)

    out = jax.lax.map(jax.checkpoint(lambda xs: fn(*xs)), tuple(split(x) for x in arrays))
    out, sums = out if summed else (out, None)
    out = jax.tree.map(lambda y: jnp.moveaxis(y, 0, 1).reshape(y.shape[1], chunks * CHUNK, *y.shape[3:])[:, :length],
                       out)
    return (out, jax.tree.map(lambda x: jnp.sum(x, axis=0), sums)) if summed else out


def attend_each(query: Array, keys: Array, values: Array, visible: Array) -> Array:
    """Each query's attention over its own key row: ``query [B, C, H, E]``, ``keys``/``values [B, C, S, K, E]``, or
    ``[B, 1, S, K, E]`` for a chunk of one row's queries, which share its keys (query head ``h`` reads key head
    ``h // (H / K)``), ``visible [B, C, S]``. Scores ``q . k / sqrt(E)``, their softmax over the visible columns and
    the weighted values, all as elementwise products summed over ``E`` and over ``S`` in order, so a query's bits
    depend on its own numbers only, shared or not; a query that sees nothing gets 0."""
    batch, chunk, heads, dim = query.shape
    kv_heads = keys.shape[3]
    precision = wide(query.dtype)
    q = query.reshape(batch, chunk, kv_heads, heads // kv_heads, dim, 1).astype(precision)
    seen = visible[:, :, None, None, :]  # [B, C, 1, 1, S]
    # each sum runs over an axis that is not the last, so XLA:CPU adds every output's terms in order in vector
    # lanes across the last axis (a row's forward pass 0.18 s, against 0.21 summed over the last axis)
    columns = jnp.moveaxis(keys, 2, -1)[:, :, :, None].astype(precision)  # [B, C, K, 1, E, S]
    scores = jnp.sum(q * columns, axis=-2) * dim ** -0.5  # [B, C, K, G, S]
    scores = jnp.where(seen, scores, jnp.finfo(precision).min)
    top = jnp.max(scores, axis=-1, keepdims=True)
    weights = jnp.where(seen, jnp.exp(scores - top), 0.0)
    total = jnp.sum(weights, axis=-1)  # [B, C, K, G]
    rows = jnp.moveaxis(values, 2, 3)[:, :, :, None].astype(precision)  # [B, C, K, 1, S, E]
    rows = jnp.where(seen[..., None], rows, 0.0)
    out = jnp.sum(weights[..., None] * rows, axis=-2)  # [B, C, K, G, E]
    out = out * (1.0 / jnp.where(total > 0, total, 1.0))[..., None]
    return out.reshape(batch, chunk, heads, dim).astype(query.dtype)


def _layer(layers: Any, h: Array, weights: dict, adapters: dict, rope: tuple[Array, Array], valid: Array,
           keep: Callable[[Array, Array], tuple[Array, Array, Array, Any]]) -> tuple[Array, Any, Any]:
    """One layer on ``h [B, T, D]``: queries, keys and values over chunks, then attention and the rest of the layer
    over chunks. ``keep(k, v)`` gives the keys and values the queries read, each query its own row ``[B, T, S, K,
    E]`` (the sampler's rows) or each row's shared by its queries ``[B, S, K, E]`` (the trainer's), the queries'
    visible columns ``[B, T, S]`` and what the layer returns besides ``h``; with experts, their router statistics
    over the ``valid [B, T]`` tokens and each token's experts, else ``None``."""
    q, k, v = over_tokens(lambda x, cos, sin: layers._qkv(x, weights, adapters, (cos, sin)), h, *rope)
    keys, values, visible, extra = keep(k, v)
    shared = keys.ndim == 4  # read whole by every chunk rather than cut with the queries ([B, T, S, ...] copies)

    def rest(x: Array, query: Array, seen: Array, ok: Array, *own: Array):
        key, value = own or (keys[:, None], values[:, None])
        x, routed = layers._after_attention(x, attend_each(query, key, value, seen), weights, adapters, ok)
        return (x, None if routed is None else routed[1]), None if routed is None else routed[0]

    own = () if shared else (keys, values)
    (h, experts), stats = over_tokens(rest, h, q, visible, valid, *own, summed=True)
    return h, extra, None if stats is None else (stats, experts)


def experts_each(x: Array, valid: Array, router: Array, gate: Array, up: Array, down: Array, top_k: int,
                 norm_topk_prob: bool, replay: Array | None = None, chunk: int = 0) -> tuple[Array, Any, Array]:
    """:func:`~jppo.models.moe.moe_mlp` with every expert run on every token of ``x [B, C, D]`` (``E`` products of
    the chunk's rows, whatever the routing; ``chunk`` unused), each token's ``k`` outputs weighted and added in
    order ``j = 0 .. k-1``: a token's output then depends on its own numbers only (the grouped products' rows
    depend on how the other tokens route). ``E / k`` times the experts' work."""
    batch, length, width = x.shape
    flat = x.reshape(-1, width)
    probs, weights, experts, lse = route(flat, router, top_k, norm_topk_prob, flat_replay(replay))
    every = jax.lax.map(lambda w: dense(jax.nn.silu(dense(flat, w[0])) * dense(flat, w[1]), w[2]),
                        tuple(w.astype(x.dtype) for w in (gate, up, down)))  # [E, N, D]
    tokens = jnp.arange(flat.shape[0])
    out = weights[:, 0, None] * every[experts[:, 0], tokens]
    for j in range(1, top_k):
        out = out + weights[:, j, None] * every[experts[:, j], tokens]
    return (out.reshape(x.shape), router_stats(probs, experts, valid.reshape(-1), lse),
            experts.reshape(batch, length, top_k))


def _layers(decoder: Any, hidden: Array, rope: tuple[Array, Array], valid: Array, keep: Callable, remat: bool
            ) -> tuple[Array, list]:
    """Every layer in turn (a scan over them, differentiated, no longer gave the forward pass's bits), each on its
    slice of the stacks; the layers with experts' statistics and experts go to
    :func:`~jppo.models.moe.record_router_stats` and ``record_routing``. Returns ``h`` and each layer's extra."""
    layers, config = decoder.layers, decoder.config

    def layer(h, weights, adapters):
        return _layer(layers, h, weights, adapters, rope, valid, keep)

    layer = jax.checkpoint(layer, prevent_cse=False) if remat else layer
    kept, routed = [], []
    for weights, adapters in layer_slices(layers._stacked_weights(), layers._stacked_adapters(), config):
        hidden, extra, experts = layer(hidden, weights, adapters)
        kept.append(extra)
        routed += [] if experts is None else [experts]
    if routed:
        record_router_stats(stack_layers([stats for stats, _ in routed]))
        record_routing(jnp.stack([experts for _, experts in routed]))
    return hidden, kept


def _rope(positions: Array, config) -> tuple[Array, Array]:
    return over_tokens(lambda p: rope_tables(p, config), positions)


def forward(decoder: Any, input_ids: Array, positions: Array, segment_ids: Array, width: int | None = None,
            one_row: bool = False) -> tuple[Array, tuple[Array, Array]]:
    """The final-norm hidden states ``[B, T, D]`` of rows ``input_ids [B, T]`` (a :class:`~jppo.models.decoder
    .Decoder`'s, on its stacked weights) and every layer's keys and values ``[L, B, S, K, E]``: ``S = width``
    columns (default ``T``), those past ``T`` zero and seen by no query (the sampler's prefill of its prompts,
    ``width`` its rows' prompt and response columns). The rule is the decoder's: column ``s`` is visible to token
    ``t`` iff ``s <= t`` and their segments are equal and not 0.

    Each product takes :data:`CHUNK` tokens of a row: ``CHUNK`` rows of ``B``, ``B CHUNK`` in all, which is
    ``CHUNK`` on a device holding one row (the trainer's passes). ``one_row``: the ``B T`` tokens as one row of
    chunks instead, for a device holding several rows (the sampler's prefill; not under a partitioned ``B``)."""
    config = decoder.config
    batch, length = input_ids.shape
    width = length if width is None else width
    shape = (1, batch * length) if one_row else (batch, length)
    embedding = decoder.embed_tokens[...].astype(config.compute_dtype)
    hidden = jnp.take(embedding, input_ids, axis=0, mode="clip").reshape(*shape, -1)
    columns = jnp.pad(segment_ids, ((0, 0), (0, width - length)))  # past T: segment 0, seen by nothing
    slots = jnp.arange(width)
    visible = ((columns[:, None, :] == segment_ids[:, :, None]) & (segment_ids[:, :, None] != 0)
               & (slots[None, None, :] <= jnp.arange(length)[None, :, None]))  # [B, T, S]

    def keep(k: Array, v: Array):
        padded = tuple(jnp.pad(x.reshape(batch, length, *x.shape[2:]), ((0, 0), (0, width - length), (0, 0), (0, 0)))
                       for x in (k, v))  # [B, S, K, E]
        rows = padded if not one_row else tuple(jnp.repeat(x, length, axis=0)[None] for x in padded)
        return (*rows, visible.reshape(*shape, width), padded)

    rope = _rope(positions.reshape(shape), config)
    hidden, kept = _layers(decoder, hidden, rope, (segment_ids != 0).reshape(shape), keep, config.remat)
    cache = tuple(jnp.stack(x) for x in zip(*kept))
    return final_norm(decoder, hidden).reshape(batch, length, -1), cache


def final_norm(decoder: Any, hidden: Array) -> Array:
    """The decoder's final norm over chunks of tokens."""
    return over_tokens(lambda x: rms_norm(x, decoder.norm[...], decoder.config.rms_norm_eps), hidden)


def decode_step(decoder: Any, tokens: Array, positions: Array, cache: tuple[Array, Array], column: Array,
                visible: Array) -> tuple[Array, tuple[Array, Array]]:
    """One new token per row: ``tokens [R]`` at ``positions [R]``, written at ``column`` (a scalar) of each row's
    keys and values in ``cache`` (``[L, R, S, K, E]`` each), attending to the columns ``visible [R, S]`` (its own
    included). Returns the final-norm hidden states ``[R, D]`` and the cache. The rows are one row of tokens here
    (``[1, R, ...]``), so :func:`over_tokens` puts ``CHUNK`` rows in each product, as the trainer puts a row's
    ``CHUNK`` tokens."""
    config = decoder.config
    embedding = decoder.embed_tokens[...].astype(config.compute_dtype)
    hidden = jnp.take(embedding, tokens, axis=0, mode="clip")[None]  # [1, R, D]
    keys, values = cache
    index = 0

    def keep(k: Array, v: Array):
        nonlocal keys, values, index
        keys = keys.at[index, :, column].set(k[0].astype(keys.dtype))
        values = values.at[index, :, column].set(v[0].astype(values.dtype))
        index += 1
        return keys[index - 1][None], values[index - 1][None], visible[None], None

    valid = jnp.ones(hidden.shape[:2], bool)
    hidden, _ = _layers(decoder, hidden, _rope(positions[None], config), valid, keep, remat=False)
    return final_norm(decoder, hidden)[0], (keys, values)
