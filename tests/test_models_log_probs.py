"""Chunked log-probs and entropy: equal to the full-logits computation in value and gradient, smaller in memory."""

import re
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jppo.losses import entropy_from_logits
from jppo.models import CausalLM, ModelConfig, create_model, token_log_probs

# a 32k vocabulary on a tiny decoder: the [B, T, V] logits dominate memory
CONFIG = ModelConfig(vocab_size=32768, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                     num_kv_heads=1, model_type="qwen2")
BATCH, LENGTH, CHUNK, TEMPERATURE = 2, 124, 8, 0.7  # 124 = 15 chunks of 8 + 4: the last chunk is padded
LOGITS_BYTES = BATCH * LENGTH * CONFIG.vocab_size * 4


def batch(seed: int = 0):
    rng = np.random.default_rng(seed)
    mask = np.ones((BATCH, LENGTH), np.int32)
    mask[1, :13] = 0  # left padding
    ids = rng.integers(0, CONFIG.vocab_size, (BATCH, LENGTH)).astype(np.int32)
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    targets = np.where(mask, np.roll(ids, -1, axis=1), -100).astype(np.int32)  # -100: a padding label
    weights = rng.standard_normal((2, BATCH, LENGTH)).astype(np.float32) * mask
    return ids, positions, mask, targets, weights


@pytest.fixture(scope="module")
def compiled():
    """Value-and-gradient of ``sum(w1 log_prob + w2 entropy)``, chunked and from full logits, compiled once."""
    graphdef, state = nnx.split(create_model(CausalLM, CONFIG, seed=0))
    ids, positions, mask, targets, weights = batch()

    def chunked(state):
        model = nnx.merge(graphdef, state)
        log_probs, entropy = token_log_probs(model, ids, positions, mask, targets, temperature=TEMPERATURE,
                                           chunk_size=CHUNK, with_entropy=True)
        return jnp.sum(weights[0] * log_probs + weights[1] * entropy), (log_probs, entropy)

    def full_logits(state):
        scaled = nnx.merge(graphdef, state)(ids, positions, mask) / TEMPERATURE
        vocabulary_log_probs = jax.nn.log_softmax(scaled, axis=-1)
        log_probs = jnp.take_along_axis(vocabulary_log_probs, np.clip(targets, 0, None)[..., None], axis=-1)[..., 0]
        entropy = -jnp.sum(jnp.exp(vocabulary_log_probs) * vocabulary_log_probs, axis=-1)
        return jnp.sum(weights[0] * log_probs + weights[1] * entropy), (log_probs, entropy)

    def build(fn):
        return jax.jit(jax.value_and_grad(fn, has_aux=True)).lower(state).compile()

    return SimpleNamespace(state=state, chunked=build(chunked), full=build(full_logits), mask=mask)


def test_chunked_values_and_gradients_equal_the_full_logits_computation(compiled):
    (value, (log_probs, entropy)), grads = compiled.chunked(compiled.state)
    (ref_value, (ref_log_probs, ref_entropy)), ref_grads = compiled.full(compiled.state)
    valid = compiled.mask.astype(bool)
    # float32 logsumexp over 32k terms: ~1e-6 relative per token on values of size ~10
    np.testing.assert_allclose(np.asarray(log_probs)[valid], np.asarray(ref_log_probs)[valid], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(entropy)[valid], np.asarray(ref_entropy)[valid], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        scale = np.abs(np.asarray(want)).max()
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * scale)  # sums of ~B*T float32 products
    assert np.isfinite(np.asarray(log_probs)).all() and np.isfinite(np.asarray(entropy)).all()
    assert (np.asarray(log_probs)[valid] <= 0).all() and (np.asarray(entropy)[valid] >= 0).all()


def test_chunked_forward_and_backward_never_hold_the_full_logits(compiled):
    chunked = compiled.chunked.memory_analysis().temp_size_in_bytes
    full = compiled.full.memory_analysis().temp_size_in_bytes
    assert full > LOGITS_BYTES  # the check can fail: the naive program does hold [B, T, V] float32
    assert chunked < LOGITS_BYTES / 2, (chunked, LOGITS_BYTES)


def test_entropy_is_that_of_the_tempered_distribution():
    """On a 2-token vocabulary the entropy has a closed form: H = -p log p - (1-p) log(1-p), p = sigmoid(dz/T)."""
    config = ModelConfig(vocab_size=2, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1,
                         initializer_range=0.3)  # p from 0.87 to 0.96
    model = CausalLM(config, rngs=nnx.Rngs(0))
    ids = jnp.array([[0, 1, 1, 0, 1]])
    positions, segments = jnp.arange(5)[None], jnp.ones((1, 5), jnp.int32)
    log_probs, entropy = token_log_probs(model, ids, positions, segments, ids, temperature=0.5, chunk_size=2,
                                       with_entropy=True)
    logits = np.asarray(model(ids), np.float64) / 0.5
    p = 1 / (1 + np.exp(logits[..., 0] - logits[..., 1]))  # probability of token 1
    # float32: logsumexp minus the expected logit loses ~1e-7 of the logits' size (~5) to cancellation
    np.testing.assert_allclose(entropy, -p * np.log(p) - (1 - p) * np.log1p(-p), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(log_probs, np.log(np.where(np.asarray(ids) == 1, p, 1 - p)), rtol=1e-5, atol=1e-6)


SMALL = ModelConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                    initializer_range=0.5)  # wide enough logits that the distributions are far from uniform
BANNED = np.zeros(SMALL.vocab_size, bool)
BANNED[[0, 3, 4, 11]] = True


class MaskedVocabLM(CausalLM):
    """A policy whose logits are ``-inf`` at the BANNED vocabulary entries, as a vocabulary mask sets them."""

    def logits(self, hidden):
        return jnp.where(BANNED, -jnp.inf, super().logits(hidden))


def _reference_log_softmax(logits) -> np.ndarray:
    """``log p_v = z_v - max z - log sum_u exp(z_u - max z)`` in float64 numpy (``-inf`` where ``z_v = -inf``)."""
    logits = np.asarray(logits, np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))


def _reference_entropy(logits) -> np.ndarray:
    """``H = -sum_v p_v log p_v`` in float64 numpy, over the entries with ``p_v > 0``."""
    log_p = _reference_log_softmax(logits)
    finite = np.isfinite(log_p)
    return -np.sum(np.exp(log_p) * np.where(finite, log_p, 0.0), axis=-1)


@pytest.mark.parametrize("model_class", [CausalLM, MaskedVocabLM], ids=["finite", "masked_vocab"])
def test_entropy_is_the_losses_one_and_safe_for_masked_vocabulary(model_class):
    """The training path's entropy is ``entropy_from_logits`` of the same tempered logits, equals a float64 numpy
    reference, and is finite with a finite gradient even where the logits hold ``-inf``."""
    graphdef, state = nnx.split(model_class(SMALL, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, SMALL.vocab_size, (2, 11)), jnp.int32)
    positions, segments = jnp.broadcast_to(jnp.arange(11), ids.shape), jnp.ones(ids.shape, jnp.int32)
    targets = jnp.roll(ids, -1, axis=1)
    allowed = ~BANNED[np.asarray(targets)] if model_class is MaskedVocabLM else np.ones(targets.shape, bool)
    temperature = 0.7

    def forward(state):
        return token_log_probs(nnx.merge(graphdef, state), ids, positions, segments, targets,
                              temperature=temperature, chunk_size=4, with_entropy=True)  # 11 = 4 + 4 + 3 (padded)

    log_probs, entropy = (np.asarray(x) for x in jax.jit(forward)(state))
    model = nnx.merge(graphdef, state)
    scaled = model.logits(model.hidden_states(ids, positions, segments)) / temperature
    assert np.isfinite(entropy).all() and np.isfinite(log_probs[allowed]).all()
    assert (log_probs[~allowed] == -np.inf).all()  # a banned target has probability 0
    # the same function on the same logits (computed in chunks here, whole there)
    np.testing.assert_allclose(entropy, np.asarray(entropy_from_logits(scaled)), rtol=1e-6)
    # float32 arithmetic against float64 math: logsumexp minus the expected logit cancels ~1e-7 of |z| ~ 1
    np.testing.assert_allclose(entropy, _reference_entropy(scaled), rtol=1e-5, atol=1e-6)
    reference_log_probs = _reference_log_softmax(scaled)
    reference_log_probs = np.take_along_axis(reference_log_probs, np.asarray(targets)[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(log_probs[allowed], reference_log_probs[allowed], rtol=1e-5, atol=1e-6)

    def objective(state):
        log_probs, entropy = forward(state)
        return jnp.sum(entropy), jnp.sum(jnp.where(allowed, log_probs, 0))

    for name, index in (("entropy", 0), ("log-probs", 1)):
        grads = jax.grad(lambda state: objective(state)[index])(state)
        leaves = jax.tree.leaves(grads)
        assert all(np.isfinite(np.asarray(leaf)).all() for leaf in leaves), f"NaN in the gradient of the {name}"
        assert any(np.abs(np.asarray(leaf)).max() > 0 for leaf in leaves), f"no gradient of the {name}"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=0.0), "temperature must be > 0"),
        (dict(chunk_size=0), "chunk_size must be a positive integer"),
        (dict(targets=jnp.zeros((1, 4), jnp.int32)), "targets shape"),
    ],
)
def test_bad_arguments(kwargs, message):
    config = ModelConfig(vocab_size=4, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1)
    model = nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(0)))
    ids = jnp.zeros((1, 5), jnp.int32)
    arguments = dict(targets=ids) | kwargs
    with pytest.raises(ValueError, match=message):
        token_log_probs(model, ids, ids, ids + 1, **arguments)


# distinctive sizes, so that an activation-gradient transpose [features, B, T] is recognisable in the compiled program
SIZED = ModelConfig(vocab_size=200, hidden_size=16, intermediate_size=48, num_layers=2, num_heads=2, num_kv_heads=1,
                    model_type="qwen2", tie_word_embeddings=False)
SIZED_B, SIZED_T = 2, 12


def one_chunk_gradient(chunk_size: int):
    """The compiled value-and-gradient of the summed log-probs of SIZED, and its inputs."""
    graphdef, state = nnx.split(create_model(CausalLM, SIZED, seed=0))
    rng = np.random.default_rng(1)
    ids = rng.integers(0, SIZED.vocab_size, (SIZED_B, SIZED_T)).astype(np.int32)
    positions = np.broadcast_to(np.arange(SIZED_T, dtype=np.int32), ids.shape)
    segments = np.ones_like(ids)
    segments[1, :3] = 0  # left padding
    targets = np.roll(ids, -1, axis=1)

    def loss(state):
        log_probs, _ = token_log_probs(nnx.merge(graphdef, state), ids, positions, segments, targets,
                                       temperature=TEMPERATURE, chunk_size=chunk_size)
        return jnp.sum(jnp.where(segments > 0, log_probs, 0.0))

    def full_logits(state):
        scaled = nnx.merge(graphdef, state)(ids, positions, segments) / TEMPERATURE
        log_probs = jnp.take_along_axis(jax.nn.log_softmax(scaled, axis=-1), targets[..., None], axis=-1)[..., 0]
        return jnp.sum(jnp.where(segments > 0, log_probs, 0.0))

    compile_ = lambda fn: jax.jit(jax.value_and_grad(fn)).lower(state).compile()  # noqa: E731
    return state, compile_(loss), compile_(full_logits)


def test_one_chunk_row_equals_full_logits_and_runs_without_checkpoint():
    """chunk_size >= T: one chunk, no checkpoint (nothing to save: the head's backward follows its forward)."""
    state, one_chunk, full = one_chunk_gradient(chunk_size=SIZED_T + 5)
    (value, grads), (ref_value, ref_grads) = one_chunk(state), full(state)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(np.asarray(want)).max())
    assert not re.findall(r'op_name="[^"]*(?:checkpoint|rematted)', one_chunk.as_text())


def test_gradient_has_no_activation_transposes_and_no_vocabulary_scatter_on_cpu():
    """The weight gradients x^T dy are 2-D products over the B*T rows (jppo.models.layers.dense): XLA:CPU then
    reads dy as it is, where from [B, T, F] activations it copied dy transposed to [F, B, T] for every weight; and
    the target's log-prob is a select, whose gradient is not a scatter into a [B, T, V] zero array."""
    _, one_chunk, _ = one_chunk_gradient(chunk_size=SIZED_T)
    hlo = one_chunk.as_text()
    transposed = re.findall(rf"= f32\[\d+,{SIZED_B},{SIZED_T}\]\S* (?:transpose|copy)\(", hlo)
    scattered = re.findall(rf"= f32\[{SIZED_B},{SIZED_T},{SIZED.vocab_size}\]\S* scatter\(", hlo)
    assert not transposed and not scattered, (transposed, scattered)
