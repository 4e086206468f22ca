"""The decoder: KV-cache decoding, packed rows, padding, grouped-query attention, value model, config errors."""

import dataclasses
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jppo.models import CausalLM, ModelConfig, ValueModel, create_model, kv_cache, layers
from jppo.models.config import AUTO_UNROLL_LAYERS
from jppo.models.layers import attention, response_blocks

# qwen3 with attention_bias: every optional parameter (q/k/v/o biases, q/k norms) is present
CONFIG = ModelConfig(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
    model_type="qwen3", attention_bias=True, max_position_embeddings=64,
)
# float32 end to end; logits are O(1) and the compared computations differ only in summation order and in
# which exact zeros (masked slots) they add, so 1e-5 of the logits' scale is ~100 float32 ulps of headroom
TOLERANCE = 1e-5


def perturbed_model(config: ModelConfig, seed: int = 0) -> CausalLM:
    """A model whose norms and biases are not 1 and 0, so that every parameter matters."""
    model = create_model(CausalLM, config, seed=seed)
    rng = np.random.default_rng(seed)
    state = jax.tree.map(lambda x: jnp.asarray(np.asarray(x) + 0.2 * rng.standard_normal(x.shape), x.dtype),
                         nnx.state(model))
    nnx.update(model, state)
    return model


@pytest.fixture(scope="module")
def lm():
    """The perturbed model, its split, and its jitted full forward and cached step (compiled once per shape)."""
    model = perturbed_model(CONFIG)
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, ids, positions, segments):
        return nnx.merge(graphdef, state)(ids, positions, segments)

    @jax.jit
    def prefill(state, ids, positions, segments):
        model = nnx.merge(graphdef, state)
        hidden, prompt = model.prefill(ids, positions, segments)
        return model.logits(hidden), prompt

    @jax.jit
    def decode(state, tokens, positions, prompt, cache, slots):
        model = nnx.merge(graphdef, state)
        hidden, cache = model.decode(tokens, positions, prompt, cache, slots, model.decoding_layers())
        return model.logits(hidden), cache

    return SimpleNamespace(model=model, graphdef=graphdef, state=state, forward=forward, prefill=prefill,
                           decode=decode)


def assert_close(actual, expected, where=None):
    actual, expected = np.asarray(actual), np.asarray(expected)
    if where is not None:
        actual, expected = actual[where], expected[where]
    np.testing.assert_allclose(actual, expected, rtol=0, atol=TOLERANCE * np.abs(expected).max())


def left_padded_batch(prompt_lengths, prompt_width, new_tokens, seed=0):
    """Ids, positions (cumsum(mask) - 1) and segments (mask) of left-padded prompts followed by new tokens."""
    rng = np.random.default_rng(seed)
    mask = np.zeros((len(prompt_lengths), prompt_width + new_tokens), np.int32)
    for row, length in enumerate(prompt_lengths):
        mask[row, prompt_width - length:] = 1
    ids = np.where(mask, rng.integers(0, CONFIG.vocab_size, mask.shape), 0).astype(np.int32)
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    return ids, positions, mask


@pytest.mark.parametrize("heads_per_row, one_slot", [(1, False), (2, True)],
                         ids=["a slot per row", "one slot for all rows, two heads per cache row"])
def test_prefill_then_decode_matches_full_forward(lm, monkeypatch, request, heads_per_row, one_slot):
    # two samples per prompt share its cache; each continues with tokens of its own (rows prompt-major). The
    # response cache may hold two heads side by side in a row (as on a TPU, kv_cache.lane_group), and the loop's
    # one slot for every row is written in place
    monkeypatch.setitem(kv_cache.LANES, jax.default_backend(), heads_per_row * CONFIG.head_dim)
    # the caches' rows are laid out while tracing: traced anew here, and again by the tests after this one
    for clear in (lm.prefill.clear_cache, lm.decode.clear_cache):
        clear()
        request.addfinalizer(clear)
    prompt_width, new_tokens, slots = 6, 5, 7  # two response slots are never written
    prompt_lengths = [6, 3, 1]
    ids, positions, segments = left_padded_batch(prompt_lengths * 2, prompt_width, new_tokens)
    order = np.array([0, 3, 1, 4, 2, 5])  # samples 0 and 1 of prompt 0, then of prompt 1, ...
    ids, positions, segments = ids[order], positions[order], segments[order]
    ids[:, :prompt_width] = ids[::2, :prompt_width].repeat(2, axis=0)  # the two samples share the prompt
    full = np.asarray(lm.forward(lm.state, ids, positions, segments))
    valid = segments.astype(bool)

    first = slice(None, None, 2)
    logits, prompt = lm.prefill(lm.state, ids[first, :prompt_width], positions[first, :prompt_width],
                                segments[first, :prompt_width])
    assert_close(logits, full[first, :prompt_width], where=valid[first, :prompt_width])
    # one copy per prompt, its heads side by side in rows as the response cache's
    assert prompt.keys[0].shape == (3, CONFIG.num_kv_heads // heads_per_row, prompt_width,
                                    heads_per_row * CONFIG.head_dim)
    cache = lm.model.init_response_cache(6, slots)
    for t in range(new_tokens):
        column = prompt_width + t
        logits, cache = lm.decode(lm.state, ids[:, column], positions[:, column], prompt, cache,
                                  np.int32(t) if one_slot else np.full(6, t))
        assert_close(logits, full[:, column])
        assert np.isfinite(np.asarray(logits)).all()
    assert len(cache.keys) == CONFIG.num_layers
    assert [block.shape for block in cache.keys[0]] == [
        (6, CONFIG.num_kv_heads // heads_per_row, size, heads_per_row * CONFIG.head_dim)
        for size in response_blocks(slots)]
    assert sum(response_blocks(slots)) == slots


@pytest.mark.parametrize("block", [1, 2, 3])
def test_decoding_over_small_response_blocks_matches_full_forward(lm, monkeypatch, block):
    # blocks of 1-3 slots: each step reads some blocks and skips the empty ones (lax.cond), the new token lands in
    # one block; rows at different slots see different blocks, and a row's junk entries past its slot stay unseen
    monkeypatch.setattr(layers, "MIN_RESPONSE_BLOCK", block)
    monkeypatch.setattr(layers, "RESPONSE_BLOCKS", 64)
    prompt_width, new_tokens = 6, 7
    ids, positions, segments = left_padded_batch([6, 3], prompt_width, new_tokens)
    full = np.asarray(lm.forward(lm.state, ids, positions, segments))
    _, prompt = lm.prefill(lm.state, ids[:, :prompt_width], positions[:, :prompt_width], segments[:, :prompt_width])
    cache = lm.model.init_response_cache(2, new_tokens)
    assert len(cache.keys[0]) == -(-new_tokens // block)
    for t in range(2):  # row 1 first writes junk at slots 0-1, then starts over two slots behind row 0
        tokens, where = np.array([ids[0, prompt_width + t], 5]), np.array([positions[0, prompt_width + t], 9])
        _, cache = lm.decode(lm.state, tokens, where, prompt, cache, np.array([t, t]))
    for t in range(2, new_tokens):
        columns = np.array([prompt_width + t, prompt_width + t - 2])
        logits, cache = lm.decode(lm.state, ids[[0, 1], columns], positions[[0, 1], columns], prompt, cache,
                                  np.array([t, t - 2]))
        assert_close(logits, full[[0, 1], columns])


@pytest.mark.parametrize("length, minimum, count, expected", [
    (1, 32, 8, (1,)), (32, 32, 8, (32,)), (33, 32, 8, (32, 1)), (128, 32, 8, (32, 32, 32, 32)),
    (512, 32, 8, (64,) * 8), (500, 32, 8, (63,) * 7 + (59,)), (7, 2, 64, (2, 2, 2, 1)),
])
def test_response_blocks_cover_the_slots_in_at_most_the_block_count(monkeypatch, length, minimum, count, expected):
    monkeypatch.setattr(layers, "MIN_RESPONSE_BLOCK", minimum)
    monkeypatch.setattr(layers, "RESPONSE_BLOCKS", count)
    assert response_blocks(length) == expected
    with pytest.raises(ValueError, match="length=0"):
        response_blocks(0)


def test_decoding_rows_at_different_slots_matches_full_forward(lm):
    # rows of one batch decode at response slots of their own (a refilled row starts over at slot 0)
    prompt_width, new_tokens = 6, 4
    ids, positions, segments = left_padded_batch([6, 3], prompt_width, new_tokens)
    full = np.asarray(lm.forward(lm.state, ids, positions, segments))
    _, prompt = lm.prefill(lm.state, ids[:, :prompt_width], positions[:, :prompt_width], segments[:, :prompt_width])
    cache = lm.model.init_response_cache(2, new_tokens)
    # row 1 first writes junk at slots 0-1 (a previous occupant), then starts over: row 0 runs two slots ahead
    for t in range(2):
        tokens, where = np.array([ids[0, prompt_width + t], 5]), np.array([positions[0, prompt_width + t], 9])
        _, cache = lm.decode(lm.state, tokens, where, prompt, cache, np.array([t, t]))
    for t in range(2, new_tokens):
        row1 = t - 2
        columns = np.array([prompt_width + t, prompt_width + row1])
        tokens, where = ids[[0, 1], columns], positions[[0, 1], columns]
        logits, cache = lm.decode(lm.state, tokens, where, prompt, cache, np.array([t, row1]))
        assert_close(logits, full[[0, 1], columns])


def test_packed_row_equals_each_sequence_alone(lm):
    lengths = [4, 2, 3]  # 9 tokens + 2 padding in an 11-token row
    rng = np.random.default_rng(1)
    sequences = [rng.integers(0, CONFIG.vocab_size, n).astype(np.int32) for n in lengths]
    width = 11
    packed_ids = np.zeros((3, width), np.int32)
    packed_positions = np.zeros((3, width), np.int32)
    packed_segments = np.zeros((3, width), np.int32)
    alone_ids, alone_positions, alone_segments = (np.zeros((3, width), np.int32) for _ in range(3))
    start = 0
    for segment, sequence in enumerate(sequences):
        n = len(sequence)
        packed_ids[0, start:start + n] = sequence
        packed_positions[0, start:start + n] = np.arange(n)
        packed_segments[0, start:start + n] = segment + 1
        alone_ids[segment, :n] = sequence
        alone_positions[segment] = np.arange(width)
        alone_segments[segment, :n] = 1
        start += n
    packed = np.asarray(lm.forward(lm.state, packed_ids, packed_positions, packed_segments))
    alone = np.asarray(lm.forward(lm.state, alone_ids, alone_positions, alone_segments))
    start = 0
    for segment, n in enumerate(lengths):
        assert_close(packed[0, start:start + n], alone[segment, :n])
        start += n
    assert np.isfinite(packed).all()  # the padding tail (segment 0) included


def test_grouped_query_attention_equals_attention_with_repeated_kv_heads(lm):
    mha_config = dataclasses.replace(CONFIG, num_kv_heads=CONFIG.num_heads)
    mha_graphdef = nnx.split(nnx.eval_shape(lambda: CausalLM(mha_config, rngs=nnx.Rngs(0))))[0]
    group = CONFIG.num_heads // CONFIG.num_kv_heads
    layers = nnx.state(lm.model).decoder.layers

    def repeat_heads(value, head_axis):  # kv head k serves query heads k*group ... k*group + group - 1
        shape = value.shape[:head_axis] + (CONFIG.num_kv_heads, CONFIG.head_dim)
        return jnp.repeat(value.reshape(shape), group, axis=head_axis).reshape(*value.shape[:head_axis], -1)

    mha_state = jax.tree.map(lambda x: x, nnx.state(lm.model))  # new Variables: lm.model's must stay as they are
    for name in ("k_proj", "v_proj"):
        mha_state.decoder.layers[name].set_value(repeat_heads(layers[name][...], 2))
    for name in ("k_bias", "v_bias"):
        mha_state.decoder.layers[name].set_value(repeat_heads(layers[name][...], 1))
    ids, positions, segments = left_padded_batch([6, 3, 1], 6, 5, seed=2)
    expected = jax.jit(lambda s: nnx.merge(mha_graphdef, s)(ids, positions, segments))(mha_state)
    assert_close(lm.forward(lm.state, ids, positions, segments), expected, where=segments.astype(bool))


def test_attention_against_a_direct_loop_including_fully_masked_queries():
    rng = np.random.default_rng(3)
    batch, length, heads, kv_heads, size = 2, 5, 4, 2, 8
    q = rng.standard_normal((batch, length, heads, size)).astype(np.float32)
    k, v = (rng.standard_normal((batch, length, kv_heads, size)).astype(np.float32) for _ in range(2))
    mask = rng.random((batch, length, length)) < 0.6
    mask[0, 2] = False  # a query that sees nothing
    out = np.asarray(attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask)))
    expected = np.zeros_like(q)
    for b in range(batch):
        for t in range(length):
            keys = np.flatnonzero(mask[b, t])
            for h in range(heads):
                if keys.size:
                    scores = k[b, keys, h // 2] @ q[b, t, h] / np.sqrt(size)
                    weights = np.exp(scores - scores.max())
                    expected[b, t, h] = weights @ v[b, keys, h // 2] / weights.sum()
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)  # float32 softmax and 8-term dot products
    np.testing.assert_array_equal(out[0, 2], 0.0)


def test_padding_is_finite_in_values_and_gradients_with_and_without_remat(lm):
    ids, positions, segments = left_padded_batch([6, 3, 0], 6, 0, seed=4)  # the last row is all padding
    ids = np.where(segments, ids, -1)  # a padding id outside the vocabulary
    remat_graphdef = nnx.split(nnx.eval_shape(lambda: CausalLM(dataclasses.replace(CONFIG, remat=True),
                                                                rngs=nnx.Rngs(0))))[0]

    def masked_loss(graphdef):
        def loss(state):
            logits = nnx.merge(graphdef, state)(ids, positions, segments)
            return jnp.sum(jnp.where(segments[..., None].astype(bool), jax.nn.log_softmax(logits), 0.0))
        return jax.jit(jax.value_and_grad(loss))

    value, grads = masked_loss(lm.graphdef)(lm.state)
    remat_value, remat_grads = masked_loss(remat_graphdef)(lm.state)
    assert np.isfinite(value)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
    np.testing.assert_allclose(remat_value, value, rtol=1e-6)  # float32, same ops recomputed
    for got, want in zip(jax.tree.leaves(remat_grads), jax.tree.leaves(grads)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    logits = np.asarray(lm.forward(lm.state, ids, positions, segments))
    assert np.isfinite(logits).all()


def test_value_model_from_policy_copies_the_decoder_and_adds_a_scalar_head(lm):
    critic = ValueModel.from_policy(lm.model, rngs=nnx.Rngs(7))
    ids, positions, segments = left_padded_batch([6, 3, 1], 6, 0, seed=5)

    @nnx.jit
    def run(policy, critic):
        return (policy.hidden_states(ids, positions, segments), critic.hidden_states(ids, positions, segments),
                critic(ids, positions, segments))

    policy_hidden, critic_hidden, values = run(lm.model, critic)
    np.testing.assert_array_equal(critic_hidden, policy_hidden)
    assert values.shape == (3, 6) and values.dtype == jnp.float32
    assert np.isfinite(np.asarray(values)).all() and np.std(np.asarray(values)) > 0
    # own buffers: a donated policy buffer must not take the critic's weights with it
    policy_embedding, critic_embedding = lm.model.decoder.embed_tokens[...], critic.decoder.embed_tokens[...]
    assert policy_embedding.unsafe_buffer_pointer() != critic_embedding.unsafe_buffer_pointer()


def test_bfloat16_compute_keeps_float32_logits_close_to_float32_compute(lm):
    bf16_config = dataclasses.replace(CONFIG, dtype="bfloat16")
    bf16_graphdef = nnx.split(nnx.eval_shape(lambda: CausalLM(bf16_config, rngs=nnx.Rngs(0))))[0]
    ids, positions, segments = left_padded_batch([6, 3, 1], 6, 5)

    @jax.jit
    def run(state):
        model = nnx.merge(bf16_graphdef, state)
        hidden, prompt = model.prefill(ids, positions, segments)
        return hidden, prompt, model.logits(hidden)

    hidden, prompt, logits = run(lm.state)
    assert hidden.dtype == prompt.keys[0].dtype == jnp.bfloat16 and logits.dtype == jnp.float32
    expected = np.asarray(lm.forward(lm.state, ids, positions, segments))
    valid = segments.astype(bool)
    # bfloat16 keeps 8 mantissa bits (relative step 2^-8 = 0.4%); two layers of rounding stay within 5%
    error = np.abs(np.asarray(logits) - expected)[valid].max() / np.abs(expected[valid]).max()
    assert error < 0.05, error


@pytest.mark.parametrize("remat", [False, True])
def test_unrolled_layers_give_the_scanned_logits_and_gradient(lm, remat):
    # the same layers, rolled into one lax.scan or unrolled: only XLA's fusion (summation order) may differ
    ids, positions, segments = left_padded_batch([6, 3, 1], 6, 5)
    targets = jnp.asarray(np.roll(ids, -1, axis=1))

    def run(layer_loop):
        config = dataclasses.replace(CONFIG, layer_loop=layer_loop, remat=remat)
        graphdef = nnx.split(nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(0))))[0]

        def loss(state):
            logits = nnx.merge(graphdef, state)(ids, positions, segments)
            picked = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1)[..., 0]
            return -jnp.sum(jnp.where(segments > 0, picked, 0.0)), logits

        (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(lm.state)
        return logits, grads

    scanned, unrolled = run("scan"), run("unroll")
    assert_close(unrolled[0], scanned[0])
    for got, want in zip(jax.tree.leaves(unrolled[1]), jax.tree.leaves(scanned[1])):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0,
                                   atol=TOLERANCE * max(np.abs(np.asarray(want)).max(), 1e-30))


def test_auto_layer_loop_unrolls_shallow_models_and_scans_deep_ones():
    shallow = dataclasses.replace(CONFIG, num_layers=AUTO_UNROLL_LAYERS)
    deep = dataclasses.replace(CONFIG, num_layers=AUTO_UNROLL_LAYERS + 1)
    assert (shallow.resolved_layer_loop, deep.resolved_layer_loop) == ("unroll", "scan")
    assert dataclasses.replace(deep, layer_loop="unroll").resolved_layer_loop == "unroll"
    assert dataclasses.replace(shallow, layer_loop="scan").resolved_layer_loop == "scan"


def test_model_input_errors(lm):
    ids = jnp.zeros((2, 4), jnp.int32)
    with pytest.raises(ValueError, match="positions shape"):
        lm.model.hidden_states(ids, jnp.zeros((2, 3), jnp.int32), jnp.ones((2, 4), jnp.int32))


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(num_heads=4, num_kv_heads=3), r"num_kv_heads=3 is invalid: it must be a divisor of num_heads=4"),
        (dict(model_type="gpt2"), "unsupported model_type 'gpt2'; supported: llama, qwen2, qwen3"),
        (dict(dtype="float8"), "dtype='float8' is not one of float32, bfloat16, float16"),
        (dict(hidden_size=30, head_dim=None), r"num_heads=4 is invalid: it must be a divisor of hidden_size=30"),
        (dict(hidden_size=36, head_dim=None), r"num_heads=4 is invalid: .*hidden_size=36 that leaves an even head"),
        (dict(head_dim=7), "head_dim=7 is invalid: it must be a positive even integer"),
        (dict(num_layers=0), "num_layers=0 is invalid: it must be a positive integer"),
        (dict(rope_theta=0.0), "rope_theta=0.0 is invalid: it must be > 0"),
        (dict(model_type="qwen2", attention_bias=False), "requires attention_bias=True"),
        (dict(model_type="llama", qk_norm=True), "requires qk_norm=False"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "unsupported rope_scaling type 'yarn'"),
        (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "missing low_freq_factor"),
        (dict(layer_loop="unrolled"), "layer_loop='unrolled' is invalid: it must be one of auto, scan, unroll"),
    ],
)
def test_bad_config_is_a_clear_error(changes, message):
    fields = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match=message):
        ModelConfig(**{**fields, **changes})


def test_config_family_flags_and_defaults():
    qwen2 = ModelConfig(vocab_size=8, hidden_size=16, intermediate_size=8, num_layers=1, num_heads=2,
                        model_type="qwen2")
    assert (qwen2.attention_bias, qwen2.attention_out_bias, qwen2.qk_norm) == (True, False, False)
    assert (qwen2.num_kv_heads, qwen2.head_dim) == (2, 8)
    scaled = dataclasses.replace(qwen2, model_type="llama", attention_bias=None, attention_out_bias=None,
                                 rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    assert scaled.rope_scaling.factor == 8.0 and (scaled.attention_bias, scaled.attention_out_bias) == (False, False)
    hash(scaled)  # static in jit
