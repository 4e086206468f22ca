"""The decoder's building blocks as pure functions of arrays: RMSNorm, rotary positions, masked grouped-query
attention and the SwiGLU MLP. Weights come in already cast to the compute dtype; norms and softmax run in float32.

Shapes: ``B`` rows, ``T`` query tokens, ``S`` key slots, ``D`` hidden size, ``H`` query heads, ``K`` key/value
heads (``H = K G``), ``E`` head size, ``F`` MLP width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jppo.models.config import ModelConfig, RopeScaling

Array = jax.Array


def wide(dtype) -> jnp.dtype:
    """The precision of norms, softmax, RoPE and logits for a compute dtype: float32, or float64 for a float64
    model (exactness tests run the whole model in float64)."""
    return jnp.promote_types(dtype, jnp.float32)


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


def attention(query: Array, key: Array, value: Array, mask: Array) -> Array:
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
    probs = jnp.where(visible, jax.nn.softmax(scores, axis=-1), 0.0)
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(value.dtype), value)
    return out.reshape(batch, length, num_heads, head_dim)


def swiglu(x: Array, gate: Array, up: Array, down: Array) -> Array:
    """``(silu(x W_gate) * (x W_up)) W_down`` with ``W_gate``, ``W_up [D, F]`` and ``W_down [F, D]``."""
    return (jax.nn.silu(x @ gate) * (x @ up)) @ down
