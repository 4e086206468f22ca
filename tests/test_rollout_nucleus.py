"""The top-p nucleus found without sorting (``nucleus_mask``) against the full sort it replaces.

The full sort is the sampler's former top-p path: ``lax.top_k`` over the whole vocabulary, :func:`nucleus_keep`
on the sorted logits, the verdicts sent back to vocabulary order. Both compute in float32 and sum the
probabilities in different orders, so a token whose mass before lies within rounding of ``p`` may go either way;
every other token must get the same verdict. "Within rounding" is judged on the exact mass before each token,
computed in float64 from the float32 logits in the same order (logit descending in IEEE total order, ties by
lower index).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jppo.rollout.processors import nucleus_keep, nucleus_mask

# float32 sums of up to 32k probabilities round by less than ~1e-6 (measured: the full sort's cumulative sum is
# off by up to 7e-7, the masked sums by up to 3e-7); verdicts closer than this to p are not compared.
ROUNDING = 2e-6
TOP_PS = (1e-9, 0.05, 0.3, 0.5, 0.9, 0.95, 0.999, 1 - 1e-7)


@jax.jit
def full_sort_keep(logits: jax.Array, top_p: jax.Array) -> jax.Array:
    best, ids = jax.lax.top_k(logits, logits.shape[-1])
    keep = nucleus_keep(best, top_p)
    return jnp.zeros(logits.shape, bool).at[jnp.arange(logits.shape[0])[:, None], ids].set(keep)


bisection_keep = jax.jit(nucleus_mask)


def exact_mass_before(logits: np.ndarray) -> np.ndarray:
    """float64 probability mass of the tokens ahead of each token in ``lax.top_k``'s order."""
    bits = logits.view(np.int32).astype(np.int64)
    keys = np.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # IEEE total order, as lax.top_k sorts (-0.0 < +0.0)
    positions = np.broadcast_to(np.arange(logits.shape[-1]), logits.shape)
    order = np.lexsort((positions, -keys), axis=-1)
    ordered = np.take_along_axis(logits.astype(np.float64), order, axis=-1)
    probs = np.exp(ordered - ordered[:, :1])
    probs /= probs.sum(axis=-1, keepdims=True)
    before = np.concatenate([np.zeros_like(probs[:, :1]), np.cumsum(probs, axis=-1)[:, :-1]], axis=-1)
    out = np.empty_like(before)
    np.put_along_axis(out, order, before, axis=-1)
    return out


def random_logits(rng: np.random.Generator, rows: int, vocab: int, kind: str) -> np.ndarray:
    """Gaussian logits at a random scale (flat to peaked); ``ties``: rounded to few distinct values; ``masked``:
    30% of the entries -inf, and one row with a single finite entry."""
    logits = rng.standard_normal((rows, vocab)) * rng.choice([0.1, 1.0, 3.0, 10.0], size=(rows, 1))
    if kind == "ties":
        logits = np.round(logits)
    if kind == "masked":
        logits[rng.random(logits.shape) < 0.3] = -np.inf
        logits[0] = -np.inf
        logits[0, rng.integers(vocab)] = 1.5
    return logits.astype(np.float32)


@pytest.mark.parametrize("vocab, seeds", [(7, 40), (50, 40), (1000, 20), (32000, 6)])
def test_bisection_keeps_the_full_sorts_nucleus(vocab: int, seeds: int) -> None:
    compared = differ = 0
    rows_fully_compared = rows = 0
    for seed in range(seeds):
        rng = np.random.default_rng(seed)
        logits = random_logits(rng, 8, vocab, ("plain", "ties", "masked")[seed % 3])
        before = exact_mass_before(logits)
        for top_p in TOP_PS:
            p = np.float32(top_p)
            new, old = np.asarray(bisection_keep(logits, p)), np.asarray(full_sort_keep(logits, p))
            # the first token has exactly 0 before it in every computation
            decided = (np.abs(before - np.float64(p)) > ROUNDING) | (before == 0)
            compared += decided.sum()
            differ += (new != old)[decided].sum()
            rows_fully_compared += decided.all(axis=-1).sum()
            rows += len(logits)
            # against the exact verdict as well: the first token always stays, the rest by their mass before
            np.testing.assert_array_equal(new[decided], (before < np.float64(p))[decided])
    assert differ == 0
    # Teeth: over 90% of all verdicts were compared, and most rows on every token (73% at 32k, 94% at 7; the
    # others are mostly p >= 0.999, whose tails lie within rounding of p, and flat rows at 32k).
    assert rows_fully_compared > 0.6 * rows and compared > 0.9 * rows * vocab


@pytest.mark.parametrize("sign_of_zero", [1.0, -1.0])
def test_ties_at_the_boundary_keep_the_lower_indices(sign_of_zero: float) -> None:
    """Eight equal logits (the rest -inf) have probability 1/8 each and exact partial sums: with p = 1/2 the four
    lowest indices stay (the fifth has exactly 1/2 before it), just above 1/2 a fifth, and a tiny p keeps the
    lowest index alone. -0.0 and +0.0 are not a tie: ``lax.top_k`` puts +0.0 first."""
    vocab = 50
    tied = np.array([3, 7, 8, 20, 21, 33, 40, 49])
    logits = np.full((1, vocab), -np.inf, np.float32)
    logits[0, tied] = 0.0 * sign_of_zero
    for top_p, kept in ((0.5, tied[:4]), (0.5 + 1e-6, tied[:5]), (1e-9, tied[:1]), (1 - 1e-7, tied)):
        expected = np.zeros((1, vocab), bool)
        expected[0, kept] = True
        p = np.float32(top_p)
        np.testing.assert_array_equal(bisection_keep(logits, p), expected)
        np.testing.assert_array_equal(full_sort_keep(logits, p), expected)
    mixed = logits.copy()
    mixed[0, 40] = -0.0 * sign_of_zero  # the other zero: ahead of all others if +0.0, behind them if -0.0
    for top_p in (1e-9, 0.5, 0.9):
        p = np.float32(top_p)
        np.testing.assert_array_equal(bisection_keep(mixed, p), full_sort_keep(mixed, p))
