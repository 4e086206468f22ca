"""The decoder's building blocks as pure functions of arrays: RMSNorm, rotary positions, masked grouped-query
attention and the SwiGLU MLP. Weights come in already cast to the compute dtype; norms and softmax run in float32.

Shapes: ``B`` rows, ``T`` query tokens, ``S`` key slots, ``D`` hidden size, ``H`` query heads, ``K`` key/value
heads (``H = K G``), ``E`` head size, ``F`` MLP width.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jppo.models.attention import (
    DEFAULT_BLOCK_KV,
    DEFAULT_BLOCK_Q,
    AttentionRule,
    blockwise_attention,
    softmax,
    wide,
)
from jppo.models.config import ModelConfig, RopeScaling
from jppo.models.decode_kernel import decode_attention as kernel_attention
from jppo.models.decode_kernel import in_kernel
from jppo.models.pallas_attention import pallas_attention
from jppo.parallel.mesh import platform

Array = jax.Array


def is_norm_scale(name: str) -> bool:
    """Whether the parameter ``name`` (the last key of its path) is an RMSNorm scale (``*norm``): one that
    :func:`rms_norm` reads in float32 whatever the compute dtype, unlike the weights read in the compute dtype."""
    return name.endswith("norm")


def rms_norm(x: Array, scale: Array, eps: float) -> Array:
    """``x / sqrt(mean(x^2) + eps) * scale`` over the last axis, computed in float32, returned in ``x.dtype``."""
    x32 = x.astype(wide(x.dtype))
    normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    return (normed * scale.astype(x32.dtype)).astype(x.dtype)


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """``f_i = theta^(-2i / E)`` for ``i < E/2`` (float32), with Llama-3 scaling when given (see RopeScaling)."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is not None:
        wavelength = 2 * np.pi / freqs
        context = scaling.original_max_position_embeddings
        blend = (context / wavelength - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        scaled = np.where(wavelength > context / scaling.low_freq_factor, freqs / scaling.factor, freqs)
        medium = (wavelength >= context / scaling.high_freq_factor) & (wavelength <= context / scaling.low_freq_factor)
        freqs = np.where(medium, (1 - blend) * scaled / scaling.factor + blend * scaled, scaled)
    return freqs.astype(np.float32)


def rope_tables(positions: Array, config: ModelConfig) -> tuple[Array, Array]:
    """``cos`` and ``sin`` of the angles ``p f_i``: float32 ``[B, T, E/2]`` for integer ``positions [B, T]``."""
    freqs = rope_inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
    angles = positions.astype(wide(config.compute_dtype))[..., None] * jnp.asarray(freqs)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
    """Rotates the pairs ``(x_i, x_{i + E/2})`` of ``x [B, T, heads, E]`` by the angles of ``cos``/``sin``:
    ``(a, b) -> (a cos - b sin, b cos + a sin)`` (the "rotate half" layout of Llama/Qwen checkpoints)."""
    first, second = jnp.split(x.astype(wide(x.dtype)), 2, axis=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x.dtype)


def attention_mask(query_segments: Array, query_slots: Array, key_segments: Array) -> Array:
    """``mask[b, t, s] = (s <= query_slots[t]) & (key_segments[b, s] == query_segments[b, t] != 0)``.

    ``query_slots [T]`` are the key-axis slots of the queries (``arange(T)`` without a cache, ``cache_index +
    arange(T)`` with one), so a query sees its own segment's earlier tokens and itself, never padding (segment 0).
    """
    key_slots = jnp.arange(key_segments.shape[1])
    causal = key_slots[None, :] <= query_slots[:, None]
    same_segment = key_segments[:, None, :] == query_segments[:, :, None]
    return causal[None] & same_segment & (query_segments != 0)[:, :, None]


# Where ``auto`` does not pick a kernel of its own: the faster on CPU for a small model's forward and backward pass
# on short rows (bench/README.md, "Attention implementations on the CPU": a tie with "xla", so the exact-in-float64
# reference stays).
AUTO_FALLBACK = "reference"
HALF_PRECISION_ATTENTION = ("bfloat16", "float16")  # the dtypes cuDNN's fused attention takes
# Rows of at least this many tokens take blocks in linear memory under ``auto`` (``blockwise`` on CPU, ``pallas`` on
# a GPU): at 1k tokens the 2-layer d256 update step took 0.76x the reference's time on CPU, 0.41x at 2k, with 0.47x
# and 0.28x its temporaries (bench/README.md, "Attention in blocks on long rows"); below 1k a row is one or two blocks.
AUTO_LONG_ROW = 1024
# The implementations that need the rule (segments and slots) rather than a dense mask.
RULE_ONLY = ("blockwise", "pallas")


def resolve_attention(name: str, dtype, backend: str, length: int = 0) -> str:
    """The implementation ``attention`` runs for the config value ``name`` (ModelConfig.attention) on rows of
    ``length`` query tokens. ``auto`` is:

    - ``reference`` for a float64 ``dtype`` (exactness tests; the kernels take their softmax in float32 or less);
    - ``pallas`` on a TPU (splash attention);
    - on a GPU, for a half-precision ``dtype``, ``cudnn`` on rows shorter than :data:`AUTO_LONG_ROW` and
      ``pallas`` (the Triton flash kernel, linear memory) on longer ones;
    - otherwise ``blockwise`` on rows of :data:`AUTO_LONG_ROW` tokens or more, :data:`AUTO_FALLBACK` below.

    Other names are returned as given."""
    if name != "auto":
        return name
    if jnp.dtype(dtype) == jnp.float64:
        return "reference"
    long_row = length >= AUTO_LONG_ROW
    if backend == "tpu":
        return "pallas"
    if backend == "gpu" and jnp.dtype(dtype).name in HALF_PRECISION_ATTENTION:
        return "pallas" if long_row else "cudnn"
    return "blockwise" if long_row else AUTO_FALLBACK


def attention(
    query: Array, key: Array, value: Array, mask: Array | AttentionRule, implementation: str = "reference",
    blocks: tuple[int, int] = (DEFAULT_BLOCK_Q, DEFAULT_BLOCK_KV),
) -> Array:
    """Grouped-query attention ``softmax(q k^T / sqrt(E) | mask) v``: by :func:`reference_attention`, for
    ``implementation`` ``"xla"``/``"cudnn"`` by :func:`fused_attention`, for ``"blockwise"`` by
    :func:`~jppo.models.attention.blockwise_attention` in ``blocks = (block_q, block_kv)``, for ``"pallas"`` by
    :func:`~jppo.models.pallas_attention.pallas_attention` (the same function, to float tolerance). ``"auto"`` is
    resolved for the traced program's platform (:func:`~jppo.parallel.mesh.platform`) by
    :func:`resolve_attention`.

    ``mask`` is a dense ``[B, T, S]`` mask or, for rows in linear memory, the :class:`AttentionRule` it is built
    from; ``blockwise`` and ``pallas`` need the rule (``auto`` falls back to the reference given a dense mask)."""
    backend = platform()
    requested, implementation = implementation, resolve_attention(implementation, query.dtype, backend, query.shape[1])
    is_rule = isinstance(mask, AttentionRule)
    if implementation in RULE_ONLY and not is_rule and requested == "auto":
        implementation = resolve_attention("auto", query.dtype, backend)  # the short rows' choice takes a mask
    if implementation in RULE_ONLY and not is_rule:
        raise ValueError(f"attention={implementation!r} needs an AttentionRule (segments and slots), not a mask")
    if implementation == "cudnn" and backend != "gpu":
        raise ValueError(f"attention='cudnn' runs on a GPU only, this backend is {backend!r}; use 'auto' or 'xla'")
    if implementation == "blockwise":
        return blockwise_attention(query, key, value, *mask, block_q=blocks[0], block_kv=blocks[1])
    if implementation == "pallas":
        return pallas_attention(query, key, value, mask, blocks)
    dense_mask = mask.mask() if is_rule else mask
    if implementation == "reference":
        return reference_attention(query, key, value, dense_mask)
    return fused_attention(query, key, value, dense_mask, implementation)


def reference_attention(query: Array, key: Array, value: Array, mask: Array) -> Array:
    """Grouped-query attention ``softmax(q k^T / sqrt(E) | mask) v``.

    ``query [B, T, H, E]``, ``key``/``value [B, S, K, E]`` (query head ``h`` reads key head ``h // (H/K)``),
    ``mask [B, T, S]``. Masked scores are replaced (not offset) before a float32 softmax and their probabilities
    zeroed after it, so a query with no visible key (padding) gets exactly 0 instead of NaN.
    """
    batch, length, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[2]
    grouped = query.reshape(batch, length, num_kv_heads, num_heads // num_kv_heads, head_dim)
    precision = wide(query.dtype)
    scores = jnp.einsum("btkgd,bskd->bkgts", grouped, key, preferred_element_type=precision)
    scores = scores * (head_dim**-0.5)
    visible = mask[:, None, None, :, :]
    scores = jnp.where(visible, scores, jnp.finfo(precision).min)
    probs = jnp.where(visible, softmax(scores, axis=-1), 0.0)
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(value.dtype), value)
    return out.reshape(batch, length, num_heads, head_dim)


def fused_attention(query: Array, key: Array, value: Array, mask: Array, implementation: str) -> Array:
    """:func:`reference_attention` by ``jax.nn.dot_product_attention`` (``implementation`` ``"xla"`` or
    ``"cudnn"``; shapes as there, GQA native, the mask broadcast over heads, scale ``E^-1/2``).

    A query with no visible key (padding) gets a uniform average of the values from the fused kernel (every score
    equally masked); it is set to 0 here, as the reference gives, so nothing of another segment leaks through it
    and its gradient is 0 too.
    """
    head_dim = query.shape[-1]
    out = jax.nn.dot_product_attention(
        query, key, value, mask=mask[:, None, :, :], scale=head_dim**-0.5, implementation=implementation
    )
    sees_a_key = jnp.any(mask, axis=-1)[:, :, None, None]
    return jnp.where(sees_a_key, out, jnp.zeros_like(out))


RESPONSE_BLOCKS = 8  # more blocks skip more empty slots; each costs a conditional and two small products
MIN_RESPONSE_BLOCK = 32


def response_blocks(length: int, blocks: int = RESPONSE_BLOCKS) -> tuple[int, ...]:
    """The slot counts of the blocks a response cache of ``length`` slots is stored in: at most ``blocks`` blocks
    of at least :data:`MIN_RESPONSE_BLOCK` slots (the last may be shorter); ``blocks = 1`` is one block.

    A decoding step reads only the blocks that hold a slot some row can see (:func:`decode_attention`), so early
    steps, when most slots are still empty, read a fraction of the cache: reading it was most of a small model's
    decode step on CPU (``python -m bench.rollout_shapes``; bench/README.md). Each block after the first costs a
    conditional per layer and token (:func:`jppo.rollout.decode.cache_block_count` chooses them per backend).
    """
    if length < 1:
        raise ValueError(f"response cache length={length} is invalid: it must be an integer >= 1")
    if blocks < 1:
        raise ValueError(f"response cache blocks={blocks} is invalid: it must be an integer >= 1")
    size = length if blocks == 1 else max(MIN_RESPONSE_BLOCK, -(-length // blocks))
    return tuple(min(size, length - start) for start in range(0, length, size))


def decode_attention(
    query: Array,
    prompt_keys: Array,
    prompt_values: Array,
    prompt_visible: Array,
    response_keys: tuple[Array, ...],
    response_values: tuple[Array, ...],
    response_visible: Array,
    known_length: int | None = None,
) -> Array:
    """One new token per row attending to its prompt's block and to its own response slots: the softmax of
    :func:`reference_attention` taken over the concatenation ``[prompt slots, response slots]``.

    ``query [R, H, E]``; ``prompt_keys``/``prompt_values [B, K / h, P, h E]`` (``h`` kv heads side by side in a
    row: :func:`~jppo.models.kv_cache.lane_group`) with ``prompt_visible [B, P]``, shared by the ``n = R / B``
    consecutive rows of each prompt (rows prompt-major), so a prompt's keys are stored and read once for its ``n``
    samples: its scores are one ``[n G, E] x [E, P]`` product per (prompt, kv head) instead of ``n``
    matrix-vector products over ``n`` copies. The response slots come in blocks (:func:`response_blocks`):
    ``response_keys``/``response_values`` hold ``[R, K / h, M_b, h E]`` per block, ``response_visible [R, M]``
    (or ``[1, M]``, the same for every row) the visible slots of all blocks in order. Heads-before-slots layouts
    make every contraction a plain batched matmul.

    Each block ``b`` gives its partial softmax: its scores' maximum ``m_b``, ``s_b = sum exp(score - m_b)`` and
    ``o_b = sum exp(score - m_b) v``; a later block no row can see is skipped (``lax.cond``: its ``m_b`` is the
    lowest float, ``s_b = o_b = 0``, what computing it would give); the first block is always computed. With
    ``m = max_b m_b`` the output is ``sum_b e^(m_b - m) o_b / sum_b e^(m_b - m)
    s_b``, the single softmax up to rounding. Masked scores are replaced before the float32 exponentials and
    their weights zeroed, as in the reference, so a row with nothing visible gets 0. ``known_length``: the slots
    every row sees when that is fixed at trace time (a step compiled at one slot, ``bench.decode_bound``): the
    blocks past them are left out of the program rather than skipped by a conditional.

    On a TPU, with one response block, it is one kernel (:func:`jppo.models.decode_kernel.decode_attention`): the
    same softmax, summed in another order, whose scores never leave the core and which reads no response tile no
    row of its program sees yet.
    """
    rows, num_heads, head_dim = query.shape
    prompts, _, prompt_len, lanes = prompt_keys.shape
    h = lanes // head_dim  # kv heads side by side in a cache row
    num_kv_heads = prompt_keys.shape[1] * h
    n, group = rows // prompts, num_heads // num_kv_heads
    precision = wide(query.dtype)
    scale = head_dim**-0.5
    lowest = jnp.finfo(precision).min
    dtype = prompt_values.dtype
    own = jnp.eye(h, dtype=precision)

    def by_prompt(x: Array) -> Array:  # [R, K, G, X] -> [B, K, n G, X]
        x = x.reshape(prompts, n, num_kv_heads, group, x.shape[-1])
        return x.transpose(0, 2, 1, 3, 4).reshape(prompts, num_kv_heads, n * group, x.shape[-1])

    def by_row(x: Array) -> Array:  # [B, K, n G, X] -> [R, K, G, X]
        x = x.reshape(prompts, num_kv_heads, n, group, x.shape[-1])
        return x.transpose(0, 2, 1, 3, 4).reshape(rows, num_kv_heads, group, x.shape[-1])

    # The caches' rows hold h heads side by side ([.., K / h, slots, h E], kv_cache.lane_group). Each head's
    # queries are spread over the row's h E entries, zero outside the head's own E, so one product per row gives
    # every head's scores; of the values' product each head keeps its own E. h = 1: the plain batched products.
    def spread(x: Array) -> Array:  # [X, K, Q, E] -> [X, K / h, h Q, h E]
        if h == 1:
            return x
        mask = own[:, None, :, None].astype(x.dtype)
        return (x.reshape(x.shape[0], num_kv_heads // h, h, x.shape[2], 1, head_dim) * mask).reshape(
            x.shape[0], num_kv_heads // h, h * x.shape[2], lanes)

    def own_lanes(mixed: Array) -> Array:  # [X, K / h, h Q, h E] -> [X, K, Q, E]
        if h == 1:
            return mixed
        queries = mixed.shape[2] // h
        mixed = mixed.reshape(mixed.shape[0], num_kv_heads // h, h, queries, h, head_dim)
        return jnp.einsum("xjiqye,iy->xjiqe", mixed, own).reshape(mixed.shape[0], num_kv_heads, queries, head_dim)

    def block_softmax(scores: Array, visible: Array) -> tuple[Array, Array, Array]:
        """``(m, exp weights, s)`` of ``scores [X, K, Q, S]`` over the ``visible [X, 1, 1, S]`` slots."""
        scores = jnp.where(visible, scores * scale, lowest)
        top = scores.max(axis=-1, keepdims=True)
        weights = jnp.where(visible, jnp.exp(scores - top), 0.0)
        return top, weights, weights.sum(axis=-1, keepdims=True)

    grouped = query.reshape(rows, num_kv_heads, group, head_dim)
    if len(response_keys) == 1 and in_kernel(prompts, prompt_len, rows, response_keys[0].shape[2], lanes, precision,
                                             response_visible.shape[0] > 1):
        # on a TPU one kernel reads the prompt's and the response's caches once (models/decode_kernel)
        lengths = jnp.broadcast_to(response_visible.sum(axis=1), (rows,))
        out = kernel_attention(spread(grouped), prompt_keys, prompt_values, prompt_visible, response_keys[0],
                               response_values[0], lengths, scale, known_length)
        return own_lanes(out).astype(query.dtype).reshape(rows, num_heads, head_dim)

    # the prompt block's softmax in the prompts' layout ([B, K, n G, P]): only its per-row results move to the
    # rows' layout, never the scores (moving those costs a write and a read of them per sample of each prompt)
    scores = jnp.einsum("bjqc,bjpc->bjqp", spread(by_prompt(grouped)), prompt_keys, preferred_element_type=precision)
    top, weights, total = block_softmax(scores.reshape(prompts, num_kv_heads, n * group, prompt_len),
                                        prompt_visible[:, None, None, :])
    weights = weights.astype(dtype).reshape(prompts, num_kv_heads // h, h * n * group, prompt_len)
    out = own_lanes(jnp.einsum("bjqp,bjpc->bjqc", weights, prompt_values, preferred_element_type=precision))
    parts = [(by_row(top), by_row(total), by_row(out))]

    def block(keys: Array, values: Array, visible: Array) -> tuple[Array, Array, Array]:
        slots = keys.shape[2]
        scores = jnp.einsum("rjqc,rjmc->rjqm", spread(grouped), keys, preferred_element_type=precision)
        top, weights, total = block_softmax(scores.reshape(rows, num_kv_heads, group, slots), visible[:, None, None, :])
        mixed = jnp.einsum("rjqm,rjmc->rjqc", weights.astype(dtype).reshape(rows, num_kv_heads // h, h * group, slots),
                           values, preferred_element_type=precision)
        return top, total, own_lanes(mixed)

    def skipped(keys: Array, values: Array, visible: Array) -> tuple[Array, Array, Array]:
        del keys, values, visible
        shape = (rows, num_kv_heads, group, 1)
        return jnp.full(shape, lowest, precision), jnp.zeros(shape, precision), jnp.zeros(shape[:-1] + (head_dim,),
                                                                                          precision)

    start = 0
    for index, (keys, values) in enumerate(zip(response_keys, response_values)):
        visible = response_visible[:, start:start + keys.shape[2]]
        start += keys.shape[2]
        if known_length is not None:  # a slot fixed at trace time: the blocks no row sees are not in the program
            if start - keys.shape[2] < known_length:
                parts.append(block(keys, values, visible))
        elif index == 0:  # slot 0 is visible from the first decoding step on: a conditional would only cost a sync
            parts.append(block(keys, values, visible))
        else:
            parts.append(jax.lax.cond(jnp.any(visible), block, skipped, keys, values, visible))
    top = functools.reduce(jnp.maximum, [m for m, _, _ in parts])
    rescale = [jnp.exp(m - top) for m, _, _ in parts]
    total = sum(r * s for r, (_, s, _) in zip(rescale, parts))
    out = sum(r * o for r, (_, _, o) in zip(rescale, parts))
    out = out / jnp.where(total > 0, total, 1.0)  # nothing visible: every weight is 0, and so is the output
    return out.astype(query.dtype).reshape(rows, num_heads, head_dim)


def dense(x: Array, kernel: Array, preferred_element_type=None) -> Array:
    """``x [..., I] @ kernel [I, O] -> [..., O]``, computed as one 2-D product ``[N, I] @ [I, O]`` over the
    flattened leading axes (``N`` = their product).

    The same numbers as ``x @ kernel``; the 2-D form is for the backward pass: the weight gradient is then
    ``x^T dy`` with both ``[N, ...]`` operands contracted over their leading axis, which XLA:CPU hands to its matmul
    as a transposed operand. From a 3-D ``x`` it instead contracts two axes, and XLA:CPU materialises a transposed
    copy of ``dy`` (``[O, N]``) for every weight gradient (``python -m bench.update_vs_torch``; bench/README.md).
    """
    flat = x.reshape(-1, x.shape[-1])
    out = jnp.matmul(flat, kernel, preferred_element_type=preferred_element_type)
    return out.reshape(*x.shape[:-1], kernel.shape[-1])


def check_inputs(input_ids: Array, positions: Array | None, segment_ids: Array | None) -> tuple[Array, Array]:
    """``(positions, segment_ids)`` of ``input_ids [B, T]``, defaulted (``arange(T)``, one segment) and checked."""
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(input_ids.shape[1], dtype=jnp.int32), input_ids.shape)
    if segment_ids is None:
        segment_ids = jnp.ones(input_ids.shape, jnp.int32)
    for name, array in (("positions", positions), ("segment_ids", segment_ids)):
        if array.shape != input_ids.shape:
            raise ValueError(
                f"{name} shape {tuple(array.shape)} does not match input_ids shape {tuple(input_ids.shape)}"
            )
    return positions, segment_ids.astype(jnp.int32)
