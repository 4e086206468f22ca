"""Routing replay's record: the experts the sampler chose for each token at each layer with experts.

A rollout of a model with experts, with ``SamplingParams.record_routing``, returns ``routed_experts
[R, P + max_new_tokens, Ls, k]`` (``Ls`` layers with experts, ``k`` experts per token) in the columns of the
rollout's token row (prompt, then response): the prompt's from the prefill, each response token's from the
decoding step that fed it. The ids are stored compactly (:func:`jppo.models.moe.routing_dtype`: one byte each up
to 255 experts); a token whose experts the sampler never computed holds :func:`jppo.models.moe.not_recorded`
(padding, and a response's last token, which is sampled but never fed back), and the trainer routes it itself.
The trainer's forward passes route by the record (:func:`jppo.models.moe.replay_routing`), so its log-probs of
the sampled tokens are computed through the experts that produced them (verl's R3, "rollout routing replay").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jppo.models.moe import not_recorded, routing_dtype

Array = jax.Array


def compact(experts: Array, num_experts: int) -> Array:
    """A forward pass's recorded experts ``[Ls, B, T, k]`` (:func:`jppo.models.moe.collect_routing`) as record
    columns ``[B, T, Ls, k]`` in the compact dtype."""
    return jnp.moveaxis(experts, 0, 2).astype(routing_dtype(num_experts))


def empty_record(rows: int, length: int, config) -> Array:
    """``[rows, length, Ls, k]`` of :func:`~jppo.models.moe.not_recorded`, the response's record before decoding."""
    shape = (rows, length, len(config.sparse_layers), config.num_experts_per_tok)
    return jnp.full(shape, not_recorded(config.num_experts), routing_dtype(config.num_experts))


def write_step(record: Array, rows: Array, columns: Array, experts: Array, live: Array) -> Array:
    """``record`` with row ``rows[r]``'s column ``columns[r]`` set to ``experts[:, r, 0]`` (a decoding step's
    ``[Ls, R, 1, k]``) where ``live[r]``; other writes dropped."""
    target = jnp.where(live, rows, record.shape[0])  # out of range: dropped
    values = jnp.moveaxis(experts[:, :, 0], 0, 1).astype(record.dtype)  # [R, Ls, k]
    return record.at[target, columns].set(values, mode="drop")


def prompt_and_response(prompt: Array, response: Array, n: int) -> Array:
    """The rollout's record ``[B n, P + L, Ls, k]``: each prompt's columns (``[B, P, Ls, k]``, repeated for its ``n``
    samples, prompt-major) before its rows' response columns ``[B n, L, Ls, k]``."""
    return jnp.concatenate([jnp.repeat(prompt, n, axis=0), response], axis=1)
