"""Continuous batching: the decoding loop over ``S = max_num_seqs`` slots, a finished row's slot taking the next
waiting row (:func:`continuous_rollout`), for :func:`jppo.rollout.decode.rollout` when a batch has more rows than
slots. Each device runs it on its own rows and slots, as the loop that decodes every row at once
(:func:`~jppo.parallel.mesh.on_each_device`)."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jppo.models.kv_cache import cache_block_count
from jppo.models.moe import collect_routing
from jppo.models.sharding import constrain
from jppo.parallel.mesh import on_each_device
from jppo.rollout.params import SamplingParams
from jppo.rollout.processors import draw, row_keys
from jppo.rollout.routing import empty_record, write_step

Array = jax.Array


@struct.dataclass
class _SlotState:
    slot_row: Array  # [S] the row a slot decodes; R when the slot is idle
    slot_step: Array  # [S] the index of the row's next token
    slot_done: Array  # [S] the row finished at its first token: free the slot at the next refill
    last_tokens: Array  # [S] the token to feed
    next_row: Array  # the first row not yet given a slot
    steps: Array  # decoding steps so far
    cache: Any
    response_ids: Array
    response_mask: Array
    log_probs: Array
    routed: Any = None  # routing replay: the response's record [R, max_new, Ls, k] (jppo.rollout.routing)


@struct.dataclass
class Responses:
    """What :func:`continuous_rollout` gives back: the response fields of a
    :class:`~jppo.rollout.decode.RolloutBatch` (the caller adds the prompts)."""

    response_ids: Array
    response_mask: Array
    log_probs: Array
    decode_slots: Array
    routed_experts: Any = None


def continuous_rollout(
    model: Any, prompt: Any, prompt_counts: Array, first_logits: Array, key: Array, params: SamplingParams,
    layers: Any, axes: tuple[str, ...],
) -> Responses:
    """Continuous batching over ``S = params.max_num_seqs`` slots: rows (prompt-major, ``R = B n``) wait in order;
    a slot whose row finished takes the next waiting row at once, so no decoding step is spent on a finished row
    while rows wait. A slot's response cache restarts at slot 0 for its new row (older entries are masked, then
    overwritten); its prompt block is read from the shared :class:`~jppo.models.PromptCache`. Row ``r`` draws its
    tokens with the keys of :func:`~jppo.rollout.processors.row_keys` and so gets the same tokens as decoding
    every row at once. ``layers``: ``model.decoding_layers()``; ``axes``: the mesh axes each device decodes its
    own rows over (:func:`~jppo.parallel.mesh.decoding_loop_axes`), with ``max_num_seqs / shards`` slots.
    """
    total = first_logits.shape[0] * params.n
    shards = int(np.prod([jax.sharding.get_abstract_mesh().shape[axis] for axis in axes]))
    loop = functools.partial(_continuous_loop, model, params, params.max_num_seqs // shards)
    out = on_each_device(loop, axes, (prompt, prompt_counts, first_logits, row_keys(key, jnp.arange(total))),
                         (layers,))
    by_row = lambda x: constrain(x, ("batch", None))  # noqa: E731  (rows leave sharded like the prompts came)
    return out.replace(response_ids=by_row(out.response_ids), response_mask=by_row(out.response_mask),
                       log_probs=by_row(out.log_probs))


def _continuous_loop(model: Any, params: SamplingParams, num_slots: int, prompt: Any, prompt_counts: Array,
                     first_logits: Array, keys: Array, layers: Any) -> Responses:
    """:func:`continuous_rollout`'s loop over ``num_slots`` slots on the rows given (one device's, or all), whose
    keys are ``keys``; ``decode_slots`` has one entry."""
    n, max_new = params.n, params.max_new_tokens
    rows = first_logits.shape[0] * n
    keys = jnp.concatenate([keys, keys[:1]])  # + an idle slot's key, never used
    eos = jnp.asarray(params.eos_token_ids, dtype=jnp.int32)

    def write(state: _SlotState, rows_written: Array, steps: Array, tokens: Array, log_probs: Array, live: Array):
        where = (jnp.where(live, rows_written, rows), steps)  # an out-of-range row: the write is dropped
        return state.replace(
            response_ids=state.response_ids.at[where].set(tokens, mode="drop"),
            response_mask=state.response_mask.at[where].set(True, mode="drop"),
            log_probs=state.log_probs.at[where].set(log_probs, mode="drop"),
        )

    def refill(state: _SlotState, free: Array) -> _SlotState:
        """Gives each free slot the next waiting row and samples that row's first token from its prompt."""
        new_row = state.next_row + jnp.cumsum(free) - 1
        take = free & (new_row < rows)
        row = jnp.where(take, new_row, rows)
        prompt_rows = jnp.minimum(row, rows - 1) // n
        tokens, log_probs = draw(keys[row], jnp.zeros_like(row), first_logits[prompt_rows], params)
        live = take & (prompt_counts[prompt_rows] > 0)  # an empty prompt gets an empty response
        state = write(state, row, jnp.zeros_like(row), tokens, log_probs, live)
        done_at_once = take & (~live | jnp.isin(tokens, eos) | (max_new == 1))
        return state.replace(
            slot_row=jnp.where(free, row, state.slot_row),
            slot_step=jnp.where(free, 1, state.slot_step),
            slot_done=jnp.where(free, done_at_once, state.slot_done),
            last_tokens=jnp.where(free, tokens, state.last_tokens),
            next_row=state.next_row + jnp.sum(take),
        )

    def busy(state: _SlotState) -> Array:
        return jnp.any(state.slot_row < rows)

    def decode_step(state: _SlotState) -> _SlotState:
        live = (state.slot_row < rows) & ~state.slot_done
        row = jnp.minimum(state.slot_row, rows - 1)
        fed = jnp.maximum(state.slot_step - 1, 0)
        with collect_routing() as routed:
            hidden, cache = model.decode(state.last_tokens, prompt_counts[row // n] + fed, prompt, state.cache,
                                         fed, layers, prompt_rows=row // n)
        if state.routed is not None:  # routing replay: the fed tokens' experts
            state = state.replace(routed=write_step(state.routed, row, fed, routed[0], live))
        step = jnp.minimum(state.slot_step, max_new - 1)
        tokens, log_probs = draw(keys[state.slot_row], step, model.logits(hidden), params)
        state = write(state.replace(cache=cache, steps=state.steps + 1), state.slot_row, step, tokens, log_probs, live)
        finished = live & (jnp.isin(tokens, eos) | (state.slot_step + 1 >= max_new))
        state = state.replace(slot_step=state.slot_step + 1, last_tokens=tokens)
        return refill(state, finished | state.slot_done | (state.slot_row >= rows))

    slots = jnp.full((num_slots,), rows, jnp.int32)
    state = _SlotState(
        slot_row=slots,
        slot_step=jnp.zeros((num_slots,), jnp.int32),
        slot_done=jnp.zeros((num_slots,), bool),
        last_tokens=jnp.zeros((num_slots,), jnp.int32),
        next_row=jnp.zeros((), jnp.int32),
        steps=jnp.zeros((), jnp.int32),
        cache=model.init_response_cache(num_slots, max_new, cache_block_count(params.cache_blocks)),
        response_ids=jnp.full((rows, max_new), params.pad_token_id, jnp.int32),
        response_mask=jnp.zeros((rows, max_new), bool),
        log_probs=jnp.zeros((rows, max_new), jnp.float32),
        routed=empty_record(rows, max_new, model.config) if params.record_routing and model.config.sparse_layers
        else None,
    )
    state = jax.lax.while_loop(busy, decode_step, refill(state, jnp.ones((num_slots,), bool)))
    return Responses(response_ids=state.response_ids, response_mask=state.response_mask, log_probs=state.log_probs,
                     decode_slots=(state.steps * num_slots)[None], routed_experts=state.routed)
