"""Turning next-token logits into a sampled token and its log-probability.

For one row with logits ``z`` (shape ``[V]``) and temperature ``T``, the *tempered distribution* is
``pi = softmax(z / T)``. Sampling draws from ``pi`` after two optional filters, applied in this order (the order
of Hugging Face's warpers and vLLM's sampler):

- top-k keeps the ``k`` tokens with the largest ``z`` (exactly ``k``: ties are broken by ``lax.top_k``);
- top-p keeps the nucleus of what is left: sorted by probability ``q_(1) >= q_(2) >= ...`` (``q`` = the tempered
  distribution renormalized over the top-k survivors), token ``(j)`` stays iff ``sum_{i<j} q_(i) < p``. That is
  the smallest prefix whose probability reaches ``p``, and it always holds the most likely token.

The sampled token is drawn from the filtered distribution renormalized over the survivors. Its log-probability
is reported under the *unfiltered* tempered distribution, ``log pi(token) = z_token / T - logsumexp(z / T)``,
because that is what the trainer recomputes from the model (it never sees the filters).

Greedy decoding is ``argmax z``. Its log-probability uses ``T`` when ``T > 0`` and ``T = 1`` otherwise, so that
``temperature=0`` (a common way of asking for greedy) still reports the model's own log-probabilities.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def logprob_temperature(temperature: float) -> float:
    """The temperature under which log-probabilities are reported: ``temperature`` if positive, else 1."""
    return temperature if temperature > 0 else 1.0


def tempered_logprob(logits: Array, tokens: Array, temperature: float) -> Array:
    """``log softmax(logits / T)[tokens]`` per row, in float32.

    Args:
        logits: ``[..., V]``.
        tokens: ``[...]`` integer token ids.
        temperature: ``T > 0``.
    """
    scaled = logits.astype(jnp.float32) / temperature
    chosen = jnp.take_along_axis(scaled, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return chosen - jax.nn.logsumexp(scaled, axis=-1)


def nucleus_keep(sorted_logits: Array, top_p: float) -> Array:
    """Which entries of descending-sorted logits form the top-p nucleus (``[..., K]`` bool).

    Entry ``j`` stays iff the probability of the entries before it, under ``softmax(sorted_logits)``, is below
    ``top_p``; entry 0 always stays. Entries equal to ``-inf`` get probability 0 and stay out unless first.
    """
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = mass_before < top_p
    # Rounding in the cumulative sum must never empty the nucleus.
    return keep.at[..., 0].set(True)


def sample_tokens(
    key: Array,
    logits: Array,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    greedy: bool = False,
) -> tuple[Array, Array]:
    """Draws one token per row and returns ``(tokens [...] int32, logprobs [...] float32)``.

    ``logprobs`` are under the unfiltered tempered distribution (see the module docstring). The filters are
    static (``top_k`` fixes a shape), so each setting compiles once; ``top_k=0`` and ``top_p=1`` switch them off.

    Args:
        key: a PRNG key; rows draw independently from it.
        logits: ``[..., V]`` next-token logits.
        temperature: ``T``; must be positive unless ``greedy``.
        top_k: keep the ``k`` most likely tokens (``0``: all). ``k >= V`` keeps all.
        top_p: nucleus mass in ``(0, 1]`` (``1``: all).
        greedy: take ``argmax logits`` and ignore the key and the filters.
    """
    logits = logits.astype(jnp.float32)
    vocab_size = logits.shape[-1]
    if greedy:
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return tokens, tempered_logprob(logits, tokens, logprob_temperature(temperature))

    scaled = logits / temperature
    k = min(top_k, vocab_size) if top_k > 0 else vocab_size
    if k == vocab_size and top_p >= 1.0:
        tokens = jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)
    else:
        # Sample among the k best in sorted order, then map the choice back to a vocabulary id.
        best, best_ids = jax.lax.top_k(scaled, k)
        if top_p < 1.0:
            best = jnp.where(nucleus_keep(best, top_p), best, -jnp.inf)
        choice = jax.random.categorical(key, best, axis=-1)
        tokens = jnp.take_along_axis(best_ids, choice[..., None], axis=-1)[..., 0].astype(jnp.int32)
    return tokens, tempered_logprob(logits, tokens, temperature)
