"""The experts' exchange over the ``expert`` mesh axis (:func:`jppo.models.moe.expert_parallel`): the group's
tokens gathered with their routing in one collective, and the exchange run in rounds of a bounded number of tokens."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jppo.parallel.mesh import EXPERT_AXIS

Array = jax.Array


def in_rounds(exchange: Callable, chunk: int, flat: Array, weights: Array, experts: Array) -> Array:
    """``exchange(flat, weights, experts)`` of ``n`` tokens as ``ceil(n / chunk)`` rounds of ``chunk`` tokens in a
    ``lax.map``, the last round padded with tokens of weight 0 (routed to expert 0, adding nothing), the padding's
    outputs dropped."""
    n = flat.shape[0]
    rounds = -(-n // chunk)
    pad = rounds * chunk - n

    def cut(a):
        return jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1)).reshape(rounds, chunk, *a.shape[1:])

    out = jax.lax.map(lambda args: exchange(*args), (cut(flat), cut(weights), cut(experts)))
    return out.reshape(rounds * chunk, -1)[:n]


def gather_routed(x: Array, weights: Array, experts: Array, num_experts: int) -> tuple[Array, Array, Array]:
    """The tokens ``x [n, D]``, their routing weights and experts ``[n, k]`` of every device of the ``expert`` axis,
    ``[e n, ...]`` in the axis' order, in one all-gather: the expert ids ride as numbers of ``x``'s dtype beside the
    weights (exact while ``num_experts`` is at most ``2^(mantissa bits + 1)``: 256 in bfloat16), so a decoded token
    pays one collective per layer, not three; with more experts than that, the ids travel on their own."""
    width, top_k = x.shape[-1], weights.shape[-1]
    if num_experts > 2 ** (jnp.finfo(x.dtype).nmant + 1):  # an id would round
        return tuple(jax.lax.all_gather(a, EXPERT_AXIS, axis=0, tiled=True) for a in (x, weights, experts))
    ids = jax.lax.stop_gradient(experts.astype(x.dtype))
    packed = jax.lax.all_gather(jnp.concatenate([x, weights.astype(x.dtype), ids], axis=-1), EXPERT_AXIS, axis=0,
                                tiled=True)
    return (packed[:, :width], packed[:, width:width + top_k],
            packed[:, width + top_k:].astype(experts.dtype))
