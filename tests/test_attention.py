"""The attention implementations (ModelConfig.attention): the fused ``jax.nn.dot_product_attention`` path against
the reference masked softmax, on packed rows with padding, grouped-query heads and a KV-cache step; the choice of
``auto``; the config key and its errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jppo.run.checks  # noqa: F401 (the components' checks of a config, as every command loads them)
from jppo.config import ConfigError, load_config
from jppo.config.views import random_model_config
from jppo.models import CausalLM, ModelConfig, create_model, token_log_probs
from jppo.models.layers import AUTO_FALLBACK, attention, attention_mask, resolve_attention

# float32 throughout; both paths take a float32 softmax of the same scores and differ only in summation order
# (and in the masked slots' exact zeros), so errors are a few ulps of O(1) values: 1e-5 leaves ~100x headroom
TOLERANCE = 1e-5


def packed_segments(rows: list[list[int]], width: int) -> np.ndarray:
    """Segment ids ``[B, width]`` of rows packed with sequences of the given lengths, the rest padding (0)."""
    segments = np.zeros((len(rows), width), np.int32)
    for row, lengths in enumerate(rows):
        start = 0
        for segment, length in enumerate(lengths, start=1):
            segments[row, start:start + length] = segment
            start += length
    return segments


def random_qkv(rng, batch, queries, keys, heads=4, kv_heads=2, size=8):
    q = rng.standard_normal((batch, queries, heads, size)).astype(np.float32)
    k, v = (rng.standard_normal((batch, keys, kv_heads, size)).astype(np.float32) for _ in range(2))
    return jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)


def values_and_gradients(implementation, q, k, v, mask, cotangent):
    """The attention output and the gradient of ``sum(output * cotangent)`` w.r.t. ``q``, ``k``, ``v``."""
    def loss(q, k, v):
        return jnp.sum(attention(q, k, v, mask, implementation) * cotangent)

    out = attention(q, k, v, mask, implementation)
    return out, jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


def assert_close(actual, expected):
    actual, expected = np.asarray(actual), np.asarray(expected)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=TOLERANCE * max(np.abs(expected).max(), 1.0))


def assert_paths_agree(q, k, v, mask, seed):
    cotangent = jnp.asarray(np.random.default_rng(seed).standard_normal(q.shape).astype(np.float32))
    out, grads = values_and_gradients("reference", q, k, v, mask, cotangent)
    fused_out, fused_grads = values_and_gradients("xla", q, k, v, mask, cotangent)
    assert np.isfinite(np.asarray(fused_out)).all()
    assert_close(fused_out, out)
    for fused_grad, grad in zip(fused_grads, grads):
        assert np.isfinite(np.asarray(fused_grad)).all()
        assert_close(fused_grad, grad)
    return np.asarray(fused_out)


def test_fused_attention_matches_reference_on_packed_rows_with_padding_and_gqa():
    segments = packed_segments([[3, 5, 1], [7], [], [2, 2, 2, 2]], width=10)  # ragged, padded, one all padding
    mask = attention_mask(jnp.asarray(segments), jnp.arange(10), jnp.asarray(segments))
    q, k, v = random_qkv(np.random.default_rng(0), batch=4, queries=10, keys=10)
    out = assert_paths_agree(q, k, v, mask, seed=1)
    np.testing.assert_array_equal(out[segments == 0], 0.0)  # padding queries: exactly 0, nothing leaks


def test_fused_attention_matches_reference_on_a_kv_cache_decode_step():
    cache_segments = packed_segments([[6], [2, 3], [4]], width=12)  # slots of the cache before this step
    index = 6
    step_segments = np.array([[1], [2], [0]], np.int32)  # the third row's new token is padding
    slots = cache_segments.copy()
    slots[:, index] = step_segments[:, 0]
    mask = attention_mask(jnp.asarray(step_segments), index + jnp.arange(1), jnp.asarray(slots))
    assert mask.shape == (3, 1, 12)
    q, k, v = random_qkv(np.random.default_rng(2), batch=3, queries=1, keys=12)
    out = assert_paths_agree(q, k, v, mask, seed=3)
    np.testing.assert_array_equal(out[2], 0.0)


def test_whole_model_log_probs_agree_under_reference_and_xla_attention():
    config = ModelConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, model_type="qwen3", max_position_embeddings=32)
    segments = packed_segments([[5, 4], [9], [3, 3, 2]], width=11)
    positions = np.zeros_like(segments)
    for row in range(len(segments)):
        for segment in set(segments[row]) - {0}:
            where = segments[row] == segment
            positions[row, where] = np.arange(where.sum())
    ids = np.where(segments > 0, np.random.default_rng(4).integers(0, config.vocab_size, segments.shape), 0)
    ids = ids.astype(np.int32)
    targets = np.roll(ids, -1, axis=1)

    def log_probs(attention_path):
        model = create_model(CausalLM, dataclasses.replace(config, attention=attention_path), seed=0)
        graphdef, state = nnx.split(model)

        @jax.jit
        def run(state):
            return token_log_probs(nnx.merge(graphdef, state), ids, positions, segments, targets)[0]

        return np.asarray(run(state))

    reference, fused = log_probs("reference"), log_probs("xla")
    real = segments > 0
    assert_close(fused[real], reference[real])  # log-probs are O(log V) ~ 4: a 4e-5 absolute bound


def test_auto_picks_cudnn_on_a_gpu_for_half_precision_and_the_measured_fallback_elsewhere():  # on short rows
    assert resolve_attention("auto", jnp.bfloat16, "gpu") == "cudnn"
    assert resolve_attention("auto", jnp.float16, "gpu") == "cudnn"
    assert resolve_attention("auto", jnp.float32, "gpu") == AUTO_FALLBACK
    assert resolve_attention("auto", jnp.bfloat16, "cpu") == AUTO_FALLBACK
    assert resolve_attention("auto", jnp.float64, "cpu") == "reference"  # dot_product_attention's softmax is f32
    assert resolve_attention("xla", jnp.float32, "cpu") == "xla"


def test_cudnn_attention_off_a_gpu_is_a_clear_error(monkeypatch):
    q, k, v = random_qkv(np.random.default_rng(5), batch=1, queries=2, keys=2)
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    with pytest.raises(ValueError, match="attention='cudnn' runs on a GPU only"):
        attention(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), jnp.ones((1, 2, 2), bool),
                  "cudnn")


def test_model_attention_key_reaches_the_model_config():
    cfg = load_config(None, ["model.attention=xla"])
    assert random_model_config(cfg, None).attention == "xla"
    assert load_config(None, []).model.attention == "reference"
    hf = random_model_config(cfg, None).to_hf()
    assert ModelConfig.from_hf(hf, attention="auto").attention == "auto"


@pytest.mark.parametrize("overrides, message", [
    (["model.attention=flash"],
     "model.attention='flash' is not valid; valid: reference, xla, cudnn, blockwise, pallas, auto"),
    (["model.attention=cudnn"], "model.dtype='float32': model.attention='cudnn' needs bfloat16 or float16"),
    (["model.attention=cudnn", "model.dtype=bfloat16", "rollout.dtype=float32"],
     "rollout.dtype='float32': model.attention='cudnn' needs bfloat16 or float16"),
])
def test_bad_attention_setting_is_a_one_line_config_error(overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config(None, overrides)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_model_config_refuses_an_unknown_attention():
    with pytest.raises(ValueError, match="attention='flash' is invalid"):
        ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2, attention="flash")


def test_the_platform_is_that_of_the_traced_programs_mesh_not_the_hosts():
    """A program for a TPU slice traced on this CPU host (libtpu's compile-only devices) must choose the TPU's
    kernels: ``platform()`` reads the devices of the mesh set at trace time, and falls back to the host's backend."""
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jppo.parallel.mesh import platform

    topology = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2")
    mesh = Mesh(np.array(topology.devices), ("data",))
    seen = []

    def traced(x):
        seen.append((platform(), resolve_attention("auto", x.dtype, platform(), 4096)))
        return x

    row = jax.ShapeDtypeStruct((4, 8), jnp.bfloat16, sharding=NamedSharding(mesh, PartitionSpec("data")))
    with jax.set_mesh(mesh):
        jax.jit(traced).lower(row)
    assert seen == [("tpu", "pallas")]
    assert platform() == "cpu"
