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


@pytest.mark.parametrize("rows, vocab, temperature", [(6, 5, 1.0), (9, 1000, 0.7), (4, 151936, 1.3)])
def test_the_one_pass_draw_takes_the_two_pass_tokens_and_log_probs(rows, vocab, temperature):
    """The decoding loop's draw (one reduction over the vocabulary, :func:`jppo.rollout.processors.one_pass_draw`)
    against each row's ``sample_tokens`` (``jax.random.categorical``, then ``log softmax``): the same tokens bit for
    bit, and log-probs to float32 rounding (atol 1e-5: a log-sum-exp of up to 152k terms summed in another order,
    with compensation; measured 2e-6). Rows with masked-out (-inf) logits, and one with a single finite logit."""
    from jppo.rollout.processors import draw

    logits = 3 * jax.random.normal(jax.random.key(vocab), (rows, vocab))
    logits = logits.at[0, : vocab // 2].set(-jnp.inf).at[1, 1:].set(-jnp.inf)
    keys = jax.vmap(lambda r: jax.random.fold_in(jax.random.key(7), r))(jnp.arange(rows))
    steps = jnp.arange(rows) % 3
    params = SamplingParams(max_new_tokens=1, temperature=temperature)
    tokens, log_probs = jax.jit(lambda k, s, z: draw(k, s, z, params))(keys, steps, logits)

    def one(key, step, row):
        token, log_prob = sample_tokens(jax.random.fold_in(key, step), row[None], temperature=temperature)
        return token[0], log_prob[0]

    expected_tokens, expected = jax.jit(jax.vmap(one))(keys, steps, logits)
    np.testing.assert_array_equal(tokens, expected_tokens)
    assert int(tokens[1]) == 0 and float(log_probs[1]) == 0.0  # the only finite logit: certain
    assert (np.asarray(tokens[0]) >= vocab // 2).all()
    np.testing.assert_allclose(log_probs, expected, rtol=0, atol=1e-5)


def test_compiled_for_a_tpu_the_draw_never_writes_the_logits():
    """The LM head and the draw of 80 rows of width 896 over a 32000-token vocabulary, compiled for a TPU v5p chip
    (compile-only devices): the bytes it accesses are the head's weights and the hidden states, not the [80, 32000]
    float32 logits too (9.8 MiB; the two-pass draw, each row's ``sample_tokens``, writes them and reads them back
    twice: asserted too, so the test fails if the fusion goes)."""
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jppo.rollout.processors import draw

    device = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x2").devices[:1]
    replicated = NamedSharding(Mesh(np.array(device), ("d",)), PartitionSpec())
    rows, width, vocab = 80, 896, 32000
    hidden = jax.ShapeDtypeStruct((rows, width), jnp.bfloat16, sharding=replicated)
    head = jax.ShapeDtypeStruct((vocab, width), jnp.bfloat16, sharding=replicated)
    keys = jax.ShapeDtypeStruct((rows,), jax.eval_shape(lambda: jax.random.key(0)).dtype, sharding=replicated)
    params = SamplingParams(max_new_tokens=1, temperature=0.8)

    def two_pass(keys, steps, logits, params):
        def one(key, step, row):
            token, log_prob = sample_tokens(jax.random.fold_in(key, step), row[None], temperature=params.temperature)
            return token[0], log_prob[0]

        return jax.vmap(one)(keys, steps, logits)

    def accessed(sampler) -> float:
        def step(hidden, head, keys):
            logits = jnp.einsum("rc,vc->rv", hidden, head, preferred_element_type=jnp.float32)
            return sampler(keys, jnp.zeros((rows,), jnp.int32), logits, params)

        return jax.jit(step).lower(hidden, head, keys).compile().cost_analysis()["bytes accessed"]

    weights, logits = vocab * width * 2, rows * vocab * 4
    one_pass = accessed(draw)
    print("MiB accessed: one pass", one_pass / 2**20, "two passes", accessed(two_pass) / 2**20)
    assert weights < one_pass < weights + logits / 2  # measured: 55.4 MiB, the weights 54.7
    assert accessed(two_pass) > weights + 2 * logits  # the logits written and read back


@pytest.mark.parametrize("temperature, filters, survivors", [
    (1.0, dict(), [0, 1, 2, 3, 4]),
    (0.6, dict(), [0, 1, 2, 3, 4]),
    (1.7, dict(top_k=3), [1, 3, 4]),
    (1.0, dict(top_p=0.6), [1, 3]),
])
def test_the_decoding_draw_over_row_keys_follows_the_tempered_filtered_softmax(temperature, filters, survivors):
    """The decoding loop's draw as it runs (jppo.rollout.processors.draw: each row its own key, folded with its
    step; without filters the one-pass Gumbel-max reduction, with them each row's sample_tokens) over 4096 rows
    of one five-token distribution: softmax(z / T) renormalized over the filter's survivors. Power: the counts
    reject the untempered distribution (T != 1) or the uniform one (T = 1) at 1e-6."""
    from jppo.rollout.processors import draw, row_keys

    keys = row_keys(jax.random.key(11), jnp.arange(DRAWS))
    steps = jnp.arange(DRAWS) % 7
    logits = jnp.broadcast_to(jnp.asarray(LOGITS, jnp.float32), (DRAWS, len(PROBS)))
    params = SamplingParams(max_new_tokens=1, temperature=temperature, **filters)
    tokens, _ = jax.jit(lambda k, s, z: draw(k, s, z, params))(keys, steps, logits)
    counts = np.bincount(np.asarray(tokens), minlength=len(PROBS))

    def tempered(t: float) -> np.ndarray:
        weights = np.zeros_like(PROBS)
        weights[survivors] = PROBS[survivors] ** (1 / t)
        return weights / weights.sum()

    assert chi_square_pvalue(counts, tempered(temperature)) > SIGNIFICANCE
    other = tempered(1.0) if temperature != 1.0 else np.full(len(PROBS), 1 / len(PROBS))
    assert chi_square_pvalue(counts, other) < 1e-6
