"""Attention in linear memory (``model.attention: blockwise`` and ``pallas``) against the reference masked softmax:
values and q/k/v gradients on packed rows with padding, grouped-query heads, empty segments, rows with no real
token, lengths that are not a multiple of the block, queries that are a slice of the row; the Pallas kernels in
interpret mode; the whole model; ``auto``'s rule; the block-size keys and their errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_attention import packed_segments  # rows packed with sequences of given lengths (a 0: an empty segment)

import jppo.run.checks  # noqa: F401 (the components' checks of a config, as every command loads them)
from jppo.config import ConfigError, load_config
from jppo.config.views import random_model_config
from jppo.models import CausalLM, ModelConfig, create_model, token_log_probs
from jppo.models.attention import AttentionRule, blockwise_attention
from jppo.models.layers import AUTO_LONG_ROW, attention, reference_attention, resolve_attention
from jppo.models.pallas_attention import pallas_attention

# Both sides take float32 softmaxes of the same float32 scores; the blocks only regroup the sums (an online
# softmax rescales partial sums by exact powers of e^(m - m')), so errors are a few ulps of O(1) values: 1e-5 of
# the largest magnitude leaves ~50x headroom. In float64 the same regrouping leaves ~1e-15; 1e-12 is generous.
FLOAT32 = 1e-5
FLOAT64 = 1e-12


def random_qkv(seed, batch, queries, keys, heads, kv_heads, size=8, dtype=np.float32):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, queries, heads, size)).astype(dtype)
    k, v = (rng.standard_normal((batch, keys, kv_heads, size)).astype(dtype) for _ in range(2))
    cotangent = rng.standard_normal((batch, queries, heads, size)).astype(dtype)
    return tuple(jnp.asarray(x) for x in (q, k, v, cotangent))


def value_and_grads(fn, q, k, v, cotangent):
    out, vjp = jax.vjp(fn, q, k, v)
    return (out, *vjp(cotangent))


def assert_close(actual, expected, tolerance):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert np.isfinite(actual).all()
    np.testing.assert_allclose(actual, expected, rtol=0, atol=tolerance * max(np.abs(expected).max(), 1.0))


def assert_matches_reference(fn, rule, q, k, v, cotangent, tolerance):
    mask = rule.mask()
    expected = value_and_grads(lambda q, k, v: reference_attention(q, k, v, mask), q, k, v, cotangent)
    actual = value_and_grads(fn, q, k, v, cotangent)
    for got, want in zip(actual, expected):
        assert_close(got, want, tolerance)
    return np.asarray(actual[0])


# ragged rows, an empty segment (lengths 0), a row of padding only, a row filled to the end; 37 tokens is not a
# multiple of any block below
ROWS = [[5, 0, 11, 3], [37], [], [2, 2, 0, 9, 1]]
LENGTH = 37


@pytest.mark.parametrize("block_q, block_kv", [(8, 16), (64, 64)])  # several blocks; one block per row
def test_blockwise_matches_the_reference_on_packed_rows_with_padding_gqa_and_empty_segments(block_q, block_kv):
    segments = jnp.asarray(packed_segments(ROWS, LENGTH))
    rule = AttentionRule.packed(segments)
    q, k, v, cotangent = random_qkv(0, len(ROWS), LENGTH, LENGTH, heads=4, kv_heads=2)
    out = assert_matches_reference(
        lambda q, k, v: blockwise_attention(q, k, v, *rule, block_q=block_q, block_kv=block_kv),
        rule, q, k, v, cotangent, FLOAT32)
    np.testing.assert_array_equal(out[np.asarray(segments) == 0], 0.0)  # padding queries: exactly 0


def test_blockwise_matches_the_reference_in_float64(x64):
    segments = jnp.asarray(packed_segments(ROWS, LENGTH))
    rule = AttentionRule.packed(segments)
    q, k, v, cotangent = random_qkv(1, len(ROWS), LENGTH, LENGTH, heads=6, kv_heads=3, dtype=np.float64)
    out = assert_matches_reference(
        lambda q, k, v: blockwise_attention(q, k, v, *rule, block_q=8, block_kv=8), rule, q, k, v, cotangent,
        FLOAT64)
    assert out.dtype == np.float64


def test_blockwise_queries_may_be_a_slice_of_the_row():
    """Context parallelism's call: this device's queries (slots 16..31 of the row) against all the row's keys."""
    segments = packed_segments(ROWS, LENGTH)
    whole = AttentionRule.packed(jnp.asarray(segments))
    start, stop = 16, 32
    rule = AttentionRule(whole.query_segments[:, start:stop], whole.key_segments, whole.query_slots[:, start:stop],
                         whole.key_slots)
    q, k, v, cotangent = random_qkv(2, len(ROWS), stop - start, LENGTH, heads=4, kv_heads=1)
    assert_matches_reference(
        lambda q, k, v: blockwise_attention(q, k, v, *rule, block_q=8, block_kv=16), rule, q, k, v, cotangent,
        FLOAT32)


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


@pytest.mark.parametrize("kernel", ["triton", "splash"])
def test_pallas_kernels_in_interpret_mode_match_the_reference(kernel):
    """The GPU (Triton) and TPU (splash) kernels, run by Pallas's interpreter on the CPU: one row of 40 tokens,
    8 of them padding at the end, an empty segment (splash pads the row to its 128-token tile), grouped-query
    heads. One row keeps the interpreter's grid small; the blockwise tests cover more rows."""
    rows, length = [[7, 0, 20, 5]], 40
    rule = AttentionRule.packed(jnp.asarray(packed_segments(rows, length)))
    q, k, v, cotangent = random_qkv(3, len(rows), length, length, heads=2, kv_heads=1)
    out = assert_matches_reference(
        lambda q, k, v: pallas_attention(q, k, v, rule, (16, 16), kernel=kernel, interpret=True),
        rule, q, k, v, cotangent, FLOAT32)
    np.testing.assert_array_equal(out[0, 32:], 0.0)  # padding queries see padding keys in the kernels: zeroed


def test_pallas_refuses_queries_that_are_a_slice_of_the_row():
    q, k, v, _ = random_qkv(4, 1, 8, 16, heads=2, kv_heads=2)
    rule = AttentionRule(jnp.ones((1, 8), jnp.int32), jnp.ones((1, 16), jnp.int32), jnp.zeros((1, 8), jnp.int32),
                         jnp.zeros((1, 16), jnp.int32))
    with pytest.raises(ValueError, match="attends a whole row to itself: 8 queries, 16 keys"):
        pallas_attention(q, k, v, rule, (8, 8))


def test_whole_model_log_probs_and_gradients_agree_under_reference_and_blockwise():
    config = ModelConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, model_type="qwen3", max_position_embeddings=64, attention_block_q=8,
                         attention_block_kv=16)
    segments = packed_segments([[9, 14], [30], [3, 0, 3, 2]], width=LENGTH)
    positions = np.zeros_like(segments)  # each sequence's own positions, from 0 where its segment starts
    for t in range(1, LENGTH):
        positions[:, t] = np.where(segments[:, t] == segments[:, t - 1], positions[:, t - 1] + 1, 0)
    ids = (np.random.default_rng(5).integers(0, config.vocab_size, segments.shape) * (segments > 0)).astype(np.int32)
    targets = np.roll(ids, -1, axis=1)

    def log_probs_and_grads(implementation):
        graphdef, state = nnx.split(create_model(CausalLM, dataclasses.replace(config, attention=implementation)))

        @jax.jit
        def run(state, ids, positions, segments, targets):
            def loss(state):
                log_probs = token_log_probs(nnx.merge(graphdef, state), ids, positions, segments, targets)[0]
                return jnp.sum(jnp.where(segments > 0, log_probs, 0.0)), log_probs
            return jax.grad(loss, has_aux=True)(state)

        grads, log_probs = run(state, ids, positions, segments, targets)
        return np.asarray(log_probs), jax.tree.leaves(grads)

    (reference, reference_grads), (blockwise, blockwise_grads) = map(log_probs_and_grads, ("reference", "blockwise"))
    real = segments > 0
    assert_close(blockwise[real], reference[real], FLOAT32)  # log-probs are O(log V) ~ 4
    for got, want in zip(blockwise_grads, reference_grads):
        assert_close(got, want, FLOAT32)


def test_a_compiled_update_on_a_long_row_holds_temporaries_linear_in_the_row_under_blockwise():
    """XLA's temporaries of a gradient step on one packed row (bench/README.md, "Attention in blocks on long
    rows"): doubling the row doubles blockwise's and quadruples the reference's, its ``[T, T]`` scores. The row is
    an argument of the compiled step, as in training (a constant would let XLA fold the block skipping away)."""
    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                         num_kv_heads=1, model_type="qwen2", max_position_embeddings=1024, attention_block_q=64,
                         attention_block_kv=64)

    def temporaries(implementation, length):
        graphdef, state = nnx.split(create_model(CausalLM, dataclasses.replace(config, attention=implementation)))
        segments = packed_segments([[length // 4, length - length // 4 - 16]], width=length)  # then 16 of padding
        ids = (np.arange(length) % config.vocab_size * (segments > 0)).astype(np.int32)

        def grad(state, ids, segments):
            def loss(state):
                model = nnx.merge(graphdef, state)
                log_probs = token_log_probs(model, ids, jnp.zeros_like(ids), segments, jnp.roll(ids, -1, axis=1))[0]
                return jnp.sum(jnp.where(segments > 0, log_probs, 0.0))
            return jax.grad(loss)(state)

        return jax.jit(grad).lower(state, ids, segments).compile().memory_analysis().temp_size_in_bytes

    growth = {name: temporaries(name, 1024) / temporaries(name, 512) for name in ("reference", "blockwise")}
    assert growth["reference"] > 3.5, growth  # the measure sees a quadratic term where there is one
    assert growth["blockwise"] < 2.2, growth


def test_auto_takes_blocks_on_long_rows_and_the_kernels_on_their_hardware():
    assert resolve_attention("auto", jnp.float32, "cpu", AUTO_LONG_ROW) == "blockwise"
    assert resolve_attention("auto", jnp.float32, "cpu", AUTO_LONG_ROW - 1) == "reference"
    assert resolve_attention("auto", jnp.float64, "cpu", 10 * AUTO_LONG_ROW) == "reference"  # exactness tests
    assert resolve_attention("auto", jnp.bfloat16, "gpu", AUTO_LONG_ROW) == "pallas"
    assert resolve_attention("auto", jnp.bfloat16, "gpu", 16) == "cudnn"
    assert resolve_attention("auto", jnp.float32, "gpu", AUTO_LONG_ROW) == "blockwise"
    assert resolve_attention("auto", jnp.bfloat16, "tpu", 16) == "pallas"


def test_auto_with_a_dense_mask_takes_the_short_rows_choice_and_blockwise_refuses_one():
    q, k, v, _ = random_qkv(6, 1, 4, 4, heads=2, kv_heads=2)
    mask = AttentionRule.packed(jnp.ones((1, 4), jnp.int32)).mask()
    np.testing.assert_array_equal(attention(q, k, v, mask, "auto"), reference_attention(q, k, v, mask))
    with pytest.raises(ValueError, match="attention='blockwise' needs an AttentionRule"):
        attention(q, k, v, mask, "blockwise")


def test_block_size_keys_reach_the_model_config():
    cfg = load_config(None, ["model.attention=blockwise", "model.attention_block_q=128",
                             "model.attention_block_kv=256"])
    config = random_model_config(cfg, None)
    assert (config.attention, config.attention_block_q, config.attention_block_kv) == ("blockwise", 128, 256)
    assert ModelConfig.from_hf(config.to_hf(), attention_block_q=64).attention_block_q == 64


@pytest.mark.parametrize("overrides, message", [
    (["model.attention_block_q=96"],
     "model.attention_block_q=96 is invalid: it must be a power of two >= 8 tokens (the GPU's Triton attention tiles "
     "are powers of two)"),
    (["model.attention_block_kv=4"],
     "model.attention_block_kv=4 is invalid: it must be a power of two >= 8 tokens (the GPU's Triton attention tiles "
     "are powers of two)"),
])
def test_a_block_size_that_does_not_fit_is_a_one_line_config_error(overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config(None, overrides)
    assert str(error.value) == message


def test_the_plan_puts_blocked_attention_activations_linear_in_the_row():
    from jppo.preflight.footprint import activation_bytes, attention_block_bytes

    mesh = {"data": 1, "fsdp": 1, "tensor": 1}
    dense = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4)
    blocked = dataclasses.replace(dense, attention="blockwise", attention_block_q=128, attention_block_kv=256)

    def per_token_rows(m, width):  # what grows with the row, the fixed block working set taken out
        return activation_bytes(m, 2, width, mesh) - attention_block_bytes(m, 2, width, mesh)

    assert per_token_rows(blocked, 8192) == 2 * per_token_rows(blocked, 4096)
    assert attention_block_bytes(blocked, 2, 8192, mesh) == attention_block_bytes(blocked, 2, 4096, mesh) > 0
    assert per_token_rows(dense, 8192) > 2 * per_token_rows(dense, 4096)  # the [w, w] scores
    assert activation_bytes(blocked, 2, 8192, mesh) < activation_bytes(dense, 2, 8192, mesh) / 8


def gpu_mesh():
    """A one-device abstract mesh whose device is an H100: what ``platform()`` reads when a program for a GPU is
    traced (here without one, and without JAX's CUDA plugin)."""
    from jax.sharding import AbstractMesh

    from jppo.parallel.mesh import MESH_AXES
    device_type = type(jax.make_mesh((1,), ("x",)).abstract_mesh.abstract_device)
    return AbstractMesh(
        (1,) * len(MESH_AXES), MESH_AXES, abstract_device=device_type("NVIDIA H100 80GB HBM3", None, "gpu")
    )


def test_blockwise_for_a_gpu_has_no_conditionals_and_the_same_numbers():
    """XLA:GPU runs a conditional by copying its predicate to the host and waiting: traced for a GPU, blockwise
    attention's forward and backward pass lower to StableHLO without one (on the CPU: one per block pair loop,
    forward and backward), computing the invisible block pairs instead, whose zeros leave every value and gradient
    bit for bit what skipping them gives."""
    rows = [[5, 0, 11, 3], [2, 2, 0, 9, 1]]
    rule = AttentionRule.packed(jnp.asarray(packed_segments(rows, 24)))
    q, k, v, cotangent = random_qkv(9, len(rows), 24, 24, heads=2, kv_heads=1)

    def forward_and_backward(q, k, v, cotangent, skip=None):
        return value_and_grads(lambda q, k, v: blockwise_attention(q, k, v, *rule, block_q=8, block_kv=8, skip=skip),
                               q, k, v, cotangent)

    conditionals = lambda text: text.count("stablehlo.case") + text.count("stablehlo.if")  # noqa: E731
    on_cpu = jax.jit(forward_and_backward).trace(q, k, v, cotangent).lower().as_text()
    with jax.sharding.use_abstract_mesh(gpu_mesh()):
        on_gpu = jax.jit(forward_and_backward).trace(q, k, v, cotangent).lower(lowering_platforms=("cuda",)).as_text()
    assert conditionals(on_cpu) == 2 and conditionals(on_gpu) == 0
    skipped, computed = (jax.jit(forward_and_backward, static_argnums=4)(q, k, v, cotangent, skip)
                         for skip in (True, False))
    for a, b in zip(skipped, computed):
        np.testing.assert_array_equal(a, b)
