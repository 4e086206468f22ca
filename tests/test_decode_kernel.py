"""The TPU decoding kernel (jppo/models/decode_kernel.py), run in Pallas's interpret mode on this CPU: the attention
it gives is the XLA computation's, on ragged prompts, rows at different slots, rows that see nothing and caches of
several tiles, and a rollout decoded through it samples what the XLA path samples."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jppo.models import CausalLM, ModelConfig, create_model, layers
from jppo.models.decode_kernel import BLOCK_SLOTS, PROMPT_TILE, fit, prompts_per_program
from jppo.models.kv_cache import cache_rows
from jppo.rollout import SamplingParams, generate, pad_prompts
from jppo.rollout.decode import make_generate_fn

# float32 softmax sums taken in another order (~1e-6 relative on O(1) logits): test_rollout's tolerance
LOG_PROB_ATOL = 2e-5


def attention_inputs(dtype, per_row: bool):
    """4 prompts x 4 samples (16 rows), 4 kv heads of 64 side by side in pairs (128-lane cache rows, as a TPU
    stores them), 2 query heads per kv head, 20-token prompts left-padded to 24 (one prompt all padding), and
    256 response slots (2 tiles): every row at slot 150, or each row at its own slot, 0 to all of them."""
    prompts, n, kv, group, width, slots, dim, h = 4, 4, 4, 2, 24, 256, 64, 2
    rows = prompts * n
    k = jax.random.split(jax.random.key(0), 6)
    normal = lambda key, shape: (2 * jax.random.normal(key, shape)).astype(dtype)  # noqa: E731
    query = normal(k[0], (rows, kv * group, dim))
    prompt_keys, prompt_values = (cache_rows(normal(key, (prompts, kv, width, dim)), h) for key in k[1:3])
    real = np.array([20, 3, 0, 24])  # real tokens per prompt, left-padded
    prompt_visible = jnp.asarray(np.arange(width)[None, :] >= width - real[:, None])
    cache = lambda key: normal(key, (rows, kv // h, slots, h * dim))  # noqa: E731
    if per_row:  # each row at its own slot (continuous batching); -1: the row sees none of the response yet
        slot = np.array([-1, 0, 1, 127, 128, 129, 255, 200, 5, 64, 190, 30, 255, 0, 100, 127])[:, None]
    else:
        slot = np.array([[150]])
    response_visible = jnp.asarray(np.arange(slots)[None, :] <= slot)
    return query, prompt_keys, prompt_values, prompt_visible, (cache(k[3]),), (cache(k[4]),), response_visible


@pytest.mark.parametrize("per_row", [False, True], ids=["one-slot", "slot-per-row"])
@pytest.mark.parametrize("dtype, tolerance", [
    # float32 throughout: the two differ only in the order the softmax's sums are taken (measured ~1e-6)
    (jnp.float32, 1e-5),
    # bfloat16 weights before the values' product and a bfloat16 output: a few bfloat16 ulps (2^-8 relative)
    (jnp.bfloat16, 3e-2),
])
def test_the_kernel_attends_as_the_xla_computation(monkeypatch, dtype, tolerance, per_row):
    inputs = attention_inputs(dtype, per_row)
    expected = jax.jit(layers.decode_attention)(*inputs)
    monkeypatch.setattr(layers, "in_kernel", lambda *_: True)  # the TPU's path, interpreted on this CPU
    got = jax.jit(layers.decode_attention)(*inputs)
    assert got.shape == expected.shape == inputs[0].shape
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(expected, np.float32), rtol=tolerance,
                               atol=tolerance)


def test_the_kernel_takes_whole_tiles_and_lane_rows_and_whole_prompts_per_program():
    assert fit(16, 512, 80, 512, 128) and fit(2, 8, 16, 5, 128)  # a cache shorter than a tile is one tile
    assert not fit(16, 512, 81, 512, 128)  # rows not the same number per prompt
    assert not fit(16, PROMPT_TILE + 8, 80, 512, 128) and not fit(16, 512, 80, BLOCK_SLOTS + 64, 128)
    assert not fit(16, 512, 80, 512, 64)  # 64-lane rows: padded to 128 in a TPU's memory
    # the GRPO configs' 16 prompts x 5 rows a device: 2 prompts a program (10 rows); PPO's 32 x 1: 8 prompts
    assert prompts_per_program(16, 5) == 2 and prompts_per_program(32, 1) == 8 and prompts_per_program(3, 2) == 3


def test_a_rollout_through_the_kernel_samples_what_the_xla_path_samples(monkeypatch):
    # 128-wide heads (full lane rows on any backend), 2 prompts x 4 samples (one program of 8 rows), 24 new
    # tokens in one cache block, float32 with O(1) logits: the same tokens, and log-probs to the float32 rounding
    # of the softmax's sums taken in another order (measured 4.3e-6)
    config = ModelConfig(vocab_size=64, hidden_size=256, intermediate_size=128, num_layers=2, num_heads=2,
                         num_kv_heads=1, initializer_range=0.1)
    model = create_model(CausalLM, config, seed=1)
    ids, mask = pad_prompts([[5, 9, 2, 7], [3, 3]], pad_id=0, length=6)
    params = SamplingParams(max_new_tokens=24, n=4, cache_blocks=1)
    expected = generate(model, ids, mask, jax.random.key(3), params)
    monkeypatch.setattr(layers, "in_kernel", lambda *_: True)
    make_generate_fn.cache_clear()  # traced anew, through the kernel (and not kept for later tests)
    try:
        got = generate(model, ids, mask, jax.random.key(3), params)
    finally:
        make_generate_fn.cache_clear()
    np.testing.assert_array_equal(got.response_ids, expected.response_ids)
    np.testing.assert_array_equal(got.response_mask, expected.response_mask)
    np.testing.assert_allclose(got.log_probs, expected.log_probs, rtol=0, atol=LOG_PROB_ATOL)
