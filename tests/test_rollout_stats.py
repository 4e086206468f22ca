"""Sampling distributions: frequencies of drawn tokens against the tempered, filtered softmax they should follow.

Every frequency test is a Pearson chi-square goodness-of-fit test at significance 1e-3 on 4096 draws from a fixed
key: a correct sampler would fail one key in a thousand, and the key is fixed, so the tests are deterministic.
Each also asserts power: the same counts reject a plausible wrong distribution at 1e-6.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import chi2

from jppo.models import CausalLM, ModelConfig, create_model
from jppo.rollout import SamplingParams, generate, pad_prompts, sample_tokens

DRAWS = 4096
SIGNIFICANCE = 1e-3

# A five-token distribution, shuffled so that the vocabulary order is not the probability order.
PROBS = np.array([0.05, 0.4, 0.1, 0.25, 0.2])
LOGITS = np.log(PROBS)

sample = jax.jit(sample_tokens, static_argnames=("temperature", "top_k", "top_p", "greedy"))


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square p-value; categories with expected count < 5 are pooled (the usual validity rule)."""
    expected = probs * counts.sum()
    small = expected < 5
    observed = np.append(counts[~small], counts[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    used = expected > 0
    if (observed[~used] > 0).any():
        return 0.0  # a draw of a probability-0 token
    statistic = ((observed[used] - expected[used]) ** 2 / expected[used]).sum()
    return float(chi2.sf(statistic, used.sum() - 1))


def draw_counts(key_seed: int, logits: np.ndarray, **filters) -> np.ndarray:
    batch = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (DRAWS, logits.shape[-1]))
    tokens, _ = sample(jax.random.key(key_seed), batch, **filters)
    return np.bincount(np.asarray(tokens), minlength=logits.shape[-1])


def renormalized(keep: list[int]) -> np.ndarray:
    probs = np.zeros_like(PROBS)
    probs[keep] = PROBS[keep] / PROBS[keep].sum()
    return probs


@pytest.mark.parametrize(
    "filters, survivors",
    [
        (dict(), [0, 1, 2, 3, 4]),
        (dict(top_k=10), [0, 1, 2, 3, 4]),  # k beyond the vocabulary keeps everything
        (dict(top_k=2), [1, 3]),
        (dict(top_p=0.6), [1, 3]),  # 0.4 < 0.6, then 0.4 + 0.25 reaches it
        (dict(top_p=0.7), [1, 3, 4]),  # 0.65 < 0.7: the third token is needed
        (dict(top_p=0.3), [1]),  # the most likely token alone already reaches p
        # top-k first, then top-p on the renormalized survivors (0.4, 0.25, 0.2)/0.85: 0.47 < 0.7 <= 0.76
        (dict(top_k=3, top_p=0.7), [1, 3]),
    ],
)
def test_filtered_draws_follow_the_renormalized_survivors(filters, survivors):
    counts = draw_counts(0, LOGITS, **filters)
    outside = np.setdiff1d(np.arange(len(PROBS)), survivors)
    assert counts[outside].sum() == 0
    if len(survivors) > 1:  # with one survivor the line above is the whole check
        assert chi_square_pvalue(counts, renormalized(survivors)) > SIGNIFICANCE
        assert chi_square_pvalue(counts, np.full(len(PROBS), 1 / len(PROBS))) < 1e-6


@pytest.mark.parametrize("filters", [dict(top_k=1), dict(top_p=1e-9), dict(greedy=True)])
def test_degenerate_filters_always_take_the_most_likely_token(filters):
    assert draw_counts(1, LOGITS, **filters)[1] == DRAWS


def test_log_probs_are_those_of_the_unfiltered_tempered_distribution():
    logits = jnp.asarray(np.stack([LOGITS, LOGITS[::-1]]), jnp.float32)
    tokens, log_probs = sample(jax.random.key(2), logits, temperature=0.5, top_k=2, top_p=0.9)
    tempered = np.stack([LOGITS, LOGITS[::-1]]) / 0.5
    want = tempered - np.log(np.exp(tempered).sum(axis=-1, keepdims=True))
    # float32 log-softmax of values of magnitude <= 6: a few ulps.
    np.testing.assert_allclose(np.asarray(log_probs), want[np.arange(2), np.asarray(tokens)], rtol=1e-6, atol=1e-6)
    # Greedy with temperature 0 reports the model's own (temperature 1) log-probabilities.
    tokens, log_probs = sample(jax.random.key(2), logits, temperature=0.0, greedy=True)
    np.testing.assert_array_equal(np.asarray(tokens), [1, 3])
    np.testing.assert_allclose(np.asarray(log_probs), np.log(PROBS[1]), rtol=1e-6)


def test_masked_out_logits_are_never_drawn():
    logits = np.array([0.0, -np.inf, 1.0, -np.inf, 0.5])
    counts = draw_counts(3, logits, top_p=0.99)
    assert counts[[1, 3]].sum() == 0 and counts.sum() == DRAWS


@pytest.mark.parametrize("temperature, other", [(1.0, 0.7), (0.7, 1.0)])
def test_first_token_of_the_model_follows_its_tempered_softmax(temperature, other):
    config = ModelConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                         initializer_range=1.0)
    model = create_model(CausalLM, config, seed=0)
    prompt_ids, prompt_mask = pad_prompts([[7, 3, 2]], pad_id=0, length=4)
    params = SamplingParams(max_new_tokens=1, temperature=temperature, n=DRAWS)
    out = generate(model, prompt_ids, prompt_mask, jax.random.key(4), params)
    counts = np.bincount(np.asarray(out.response_ids)[:, 0], minlength=16)
    # Reference: the model's plain forward pass over the unpadded prompt.
    logits = np.asarray(model(jnp.asarray([[7, 3, 2]])), np.float64)[0, -1]

    def tempered(t: float) -> np.ndarray:
        z = np.exp((logits - logits.max()) / t)
        return z / z.sum()

    assert chi_square_pvalue(counts, tempered(temperature)) > SIGNIFICANCE
    assert chi_square_pvalue(counts, tempered(other)) < 1e-6
