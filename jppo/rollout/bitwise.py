"""The sampler of ``trainer.deterministic: bitwise``: each sampled token's log-probability is the trainer's, bit for
bit (``rollout_corr/kl`` exactly 0).

It runs the decoder's bitwise path (:mod:`jppo.models.bitwise`) instead of the caches of :mod:`jppo.rollout.decode`:
the prompts are prefilled by the trainer's own pass (:func:`~jppo.models.bitwise.forward`) with their keys and
values padded to the rows' width ``S = P + max_new_tokens``, each row's cache is that row of ``S`` columns (the
prompt's, then the response's as they are written), and every decoding step is
:func:`~jppo.models.bitwise.decode_step` over all ``S`` columns. The tokens are drawn as the default sampler draws
them (:func:`~jppo.rollout.processors.draw`, the same keys); the log-probability kept for each is
:func:`~jppo.models.log_probs.bitwise_log_probs` of the step's hidden states, the trainer's function.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jppo.models import bitwise
from jppo.models.log_probs import bitwise_log_probs
from jppo.rollout.params import SamplingParams
from jppo.rollout.processors import draw, row_keys

Array = jax.Array


def sample_rows(model: Any, prompt_ids: Array, prompt_mask: Array, key: Array, params: SamplingParams,
                first_row: Any = 0) -> dict[str, Array]:
    """``params.n`` responses to each of ``prompt_ids [B, P]`` (int32, ``prompt_mask`` bool), rows prompt-major,
    drawn with the keys of global rows ``first_row`` on: ``response_ids``, ``response_mask`` and ``log_probs``
    ``[B n, max_new_tokens]`` and ``steps``, the decoding loop's step count (as :mod:`jppo.rollout.decode`'s)."""
    batch, prompt_len = prompt_ids.shape
    n, max_new = params.n, params.max_new_tokens
    rows, width = batch * n, prompt_len + max_new
    counts = jnp.cumsum(prompt_mask, axis=1, dtype=jnp.int32)
    positions = jnp.where(prompt_mask, counts - 1, 0)
    hidden, cache = bitwise.forward(model.decoder, prompt_ids, positions, prompt_mask.astype(jnp.int32), width,
                                    one_row=True)
    cache = tuple(jnp.repeat(x, n, axis=1) for x in cache)  # [L, R, S, K, E]: each row its prompt's columns
    last_real = prompt_len - 1 - jnp.argmax(prompt_mask[:, ::-1], axis=1)
    first_hidden = jnp.repeat(jnp.take_along_axis(hidden, last_real[:, None, None], axis=1)[:, 0], n, axis=0)
    prompt_tokens = jnp.repeat(counts[:, -1], n)
    prompt_visible = jnp.repeat(prompt_mask, n, axis=0)
    keys = row_keys(key, first_row + jnp.arange(rows))

    def record(state: dict, hidden: Array) -> dict:
        """Token ``state["step"]`` of each row from its hidden state ``[R, D]``, padding for finished rows."""
        step = state["step"]
        tokens, _ = draw(keys, jnp.broadcast_to(step, (rows,)), model.logits(hidden), params)
        log_probs = bitwise_log_probs(model, hidden[None], tokens[None], params.temperature)[0][0]
        live = ~state["done"]
        tokens = jnp.where(live, tokens, params.pad_token_id)
        ended = jnp.isin(tokens, jnp.asarray(params.eos_token_ids, dtype=jnp.int32)) & live
        return dict(state, step=step + 1, last=tokens, done=state["done"] | ended,
                    response_ids=state["response_ids"].at[:, step].set(tokens),
                    response_mask=state["response_mask"].at[:, step].set(live),
                    log_probs=state["log_probs"].at[:, step].set(jnp.where(live, log_probs, 0.0)))

    state = dict(step=jnp.zeros((), jnp.int32), last=jnp.zeros((rows,), jnp.int32), done=prompt_tokens == 0,
                 cache=cache, response_ids=jnp.full((rows, max_new), params.pad_token_id, jnp.int32),
                 response_mask=jnp.zeros((rows, max_new), bool), log_probs=jnp.zeros((rows, max_new), jnp.float32))
    state = record(state, first_hidden)

    def unfinished(state: dict) -> Array:
        return (state["step"] < max_new) & ~jnp.all(state["done"])

    def decode(state: dict) -> dict:
        fed = state["step"] - 1  # the response slot of the token fed now, at column P + fed of every row
        seen = jnp.concatenate([prompt_visible, jnp.broadcast_to(jnp.arange(max_new) <= fed, (rows, max_new))], 1)
        hidden, cache = bitwise.decode_step(model.decoder, state["last"], prompt_tokens + fed, state["cache"],
                                            prompt_len + fed, seen)
        return record(dict(state, cache=cache), hidden)

    state = jax.lax.while_loop(unfinished, decode, state)
    return {name: state[name] for name in ("response_ids", "response_mask", "log_probs")} | {"steps": state["step"]}
