"""The KV-cache sampler: decoding equals full recomputation, stopping rules, row layout, keys, buckets, errors.

Token frequencies against the tempered softmax are in ``test_rollout_stats.py``.

Most tests use ``TinyLM``, a one-layer attention model that implements the ``CausalLM`` API with a real cache
(explicit positions, segment ids, the same attention rule) and compiles several times faster. Equivalence with
full recomputation, filtered sampling and sharding over a mesh are also checked with the real
``jppo.models.CausalLM``.

Expected values come from full forward passes of the model (``model(ids, positions, segment_ids)``) over the
whole sequence, reduced with numpy in float64; never from the sampler.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, struct

from jppo.models import CausalLM, ModelConfig, create_model, layers, param_shardings
from jppo.parallel.mesh import batch_spec, make_mesh
from jppo.rollout import RolloutBatch, SamplingParams, bucket_length, generate, make_generate_fn, pad_prompts

# Cached and full-sequence logits differ only in float32 summation order (~1e-6 relative on O(1) logits); 2e-5
# absolute on log-probs leaves room for the logsumexp of a few dozen terms.
LOG_PROB_ATOL = 2e-5


@struct.dataclass
class TinyPrompt:
    keys: jax.Array  # [B, P, dim]
    values: jax.Array
    visible: jax.Array  # [B, P]


@struct.dataclass
class TinyResponse:
    keys: jax.Array  # [R, M, dim]
    values: jax.Array


@dataclasses.dataclass(frozen=True)
class TinyConfig:
    vocab_size: int
    dim: int


class TinyLM(nnx.Module):
    """One attention layer over token + sinusoidal position embeddings; the ``CausalLM`` call signatures."""

    def __init__(self, config: TinyConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.embed = nnx.Embed(config.vocab_size, config.dim, rngs=rngs)
        self.qkv = nnx.Linear(config.dim, 3 * config.dim, rngs=rngs)
        # A larger output scale spreads the next-token distribution, so temperature and filters matter.
        self.head = nnx.Linear(config.dim, config.vocab_size, kernel_init=nnx.initializers.normal(1.0), rngs=rngs)

    def _qkv(self, input_ids, positions):
        dim = self.config.dim
        freqs = 1.0 / 10.0 ** (jnp.arange(dim) / dim)
        x = self.embed(input_ids) + jnp.sin(positions[..., None] * freqs)
        return (x, *jnp.split(self.qkv(x), 3, axis=-1))

    def _attend(self, x, q, keys, values, allowed):
        scores = jnp.where(allowed, jnp.einsum("bqd,bkd->bqk", q, keys) / np.sqrt(self.config.dim), -1e30)
        return jnp.tanh(x + jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(scores, axis=-1), values))

    def hidden_states(self, input_ids, positions, segment_ids):
        x, q, k, v = self._qkv(input_ids, positions)
        slots = jnp.arange(input_ids.shape[1])
        allowed = ((slots[None, None, :] <= slots[None, :, None])
                   & (segment_ids[:, None, :] == segment_ids[:, :, None]) & (segment_ids[:, :, None] != 0))
        return self._attend(x, q, k, v, allowed)

    def prefill(self, input_ids, positions, segment_ids, layers=None):
        _, _, k, v = self._qkv(input_ids, positions)
        return self.hidden_states(input_ids, positions, segment_ids), TinyPrompt(k, v, segment_ids != 0)

    def init_response_cache(self, rows, length, blocks=1):
        zeros = jnp.zeros((rows, length, self.config.dim), jnp.float32)
        return TinyResponse(zeros, zeros)

    def for_decoding(self):
        return self

    def decoding_layers(self):
        return ()

    def decode(self, tokens, positions, prompt, cache, slots, layers, prompt_rows=None):
        x, q, k, v = self._qkv(tokens[:, None], positions[:, None])
        rows = tokens.shape[0]
        slots = jnp.broadcast_to(slots, (rows,))  # a scalar: every row at the same slot
        cache = TinyResponse(cache.keys.at[jnp.arange(rows), slots].set(k[:, 0]),
                             cache.values.at[jnp.arange(rows), slots].set(v[:, 0]))
        if prompt_rows is None:  # rows are prompt-major
            prompt_rows = jnp.arange(rows) // (rows // prompt.keys.shape[0])
        keys = jnp.concatenate([prompt.keys[prompt_rows], cache.keys], axis=1)
        values = jnp.concatenate([prompt.values[prompt_rows], cache.values], axis=1)
        response_visible = jnp.arange(cache.keys.shape[1])[None, :] <= slots[:, None]
        allowed = jnp.concatenate([prompt.visible[prompt_rows], response_visible], axis=1)[:, None, :]
        return self._attend(x, q, keys, values, allowed)[:, 0], cache

    def logits(self, hidden):
        return self.head(hidden).astype(jnp.float32)

    def __call__(self, input_ids, positions=None, segment_ids=None):
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(input_ids.shape[1]), input_ids.shape)
        if segment_ids is None:
            segment_ids = jnp.ones(input_ids.shape, jnp.int32)
        return self.logits(self.hidden_states(input_ids, positions, segment_ids))


VOCAB = 16


@pytest.fixture(scope="module")
def tiny() -> TinyLM:
    return TinyLM(TinyConfig(vocab_size=VOCAB, dim=16), rngs=nnx.Rngs(0))


# Grouped-query attention with q/k/v biases. The wide initialisation makes next-token distributions peaked: with
# the default 0.02 the logits are nearly uniform and float32 rounding alone could flip a greedy argmax.
CAUSAL_LM_CONFIG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                               num_kv_heads=2, model_type="qwen2", initializer_range=0.5)


@pytest.fixture(scope="module")
def causal_lm() -> CausalLM:
    return create_model(CausalLM, CAUSAL_LM_CONFIG, seed=0)


@pytest.fixture(params=["tiny", "causal_lm"])
def model(request):
    return request.getfixturevalue(request.param)


# ---------------------------------------------------------------------------------------------------------------
# References: full forward passes over whole sequences, reduced in numpy.

_FORWARDS: dict = {}


def full_logits(model, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Logits [B, L, V] (float64) of a full forward pass; masked slots are padding (segment 0)."""
    graphdef, state = nnx.split(model)
    if graphdef not in _FORWARDS:
        _FORWARDS[graphdef] = jax.jit(lambda st, i, p, s: nnx.merge(graphdef, st)(i, p, s))
    positions = np.where(mask, np.cumsum(mask, axis=1) - 1, 0)
    logits = _FORWARDS[graphdef](state, jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(mask, jnp.int32))
    return np.asarray(logits, np.float64)


def log_softmax(x: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    z = x / temperature
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def reference_greedy(model, prompt_ids: np.ndarray, prompt_mask: np.ndarray, steps: int):
    """Greedy decoding that re-runs the full forward on the growing sequence at every step."""
    rows, prompt_len = prompt_ids.shape
    ids = np.zeros((rows, prompt_len + steps), np.int32)
    mask = np.zeros((rows, prompt_len + steps), bool)
    ids[:, :prompt_len], mask[:, :prompt_len] = prompt_ids, prompt_mask
    log_probs = np.zeros((rows, steps))
    for t in range(steps):
        # Slots after the current end are padding, which no real token attends to.
        scores = full_logits(model, ids, mask)[:, prompt_len + t - 1]
        ids[:, prompt_len + t] = scores.argmax(axis=-1)
        mask[:, prompt_len + t] = True
        log_probs[:, t] = log_softmax(scores)[np.arange(rows), ids[:, prompt_len + t]]
    return ids[:, prompt_len:], log_probs


def next_token_logits(model, out: RolloutBatch) -> np.ndarray:
    """[R, max_new, V]: the logits that predicted each response slot, from one full forward pass."""
    ids = np.concatenate([np.asarray(out.prompt_ids), np.asarray(out.response_ids)], axis=1)
    mask = np.concatenate([np.asarray(out.prompt_mask), np.asarray(out.response_mask)], axis=1)
    prompt_len, max_new = out.prompt_ids.shape[1], out.response_ids.shape[1]
    return full_logits(model, ids, mask)[:, prompt_len - 1 : prompt_len - 1 + max_new]


PROMPTS = [[3, 1, 4, 1, 5], [9, 2], [6, 5, 3, 5, 8, 9, 7], [11]]


# ---------------------------------------------------------------------------------------------------------------
# KV-cache decoding vs full recomputation, stopping.


def test_greedy_decoding_equals_full_recomputation(model):
    prompt_ids, prompt_mask = pad_prompts(PROMPTS, pad_id=0, multiple=8)
    out = generate(model, prompt_ids, prompt_mask, jax.random.key(0), SamplingParams(max_new_tokens=6, greedy=True))
    want_ids, want_log_probs = reference_greedy(model, prompt_ids, prompt_mask, 6)
    np.testing.assert_array_equal(np.asarray(out.response_ids), want_ids)
    assert np.asarray(out.response_mask).all()
    np.testing.assert_allclose(np.asarray(out.log_probs), want_log_probs, atol=LOG_PROB_ATOL)
    np.testing.assert_array_equal(np.asarray(out.prompt_ids), prompt_ids)
    assert out.response_ids.dtype == jnp.int32 and out.log_probs.dtype == jnp.float32


def test_right_padded_prompts_continue_after_their_last_real_token(tiny):
    left_ids, left_mask = pad_prompts(PROMPTS, pad_id=0, multiple=8)
    right_ids, right_mask = np.zeros_like(left_ids), np.zeros_like(left_mask)
    for row, prompt in enumerate(PROMPTS):
        right_ids[row, : len(prompt)], right_mask[row, : len(prompt)] = prompt, True
    out = generate(tiny, right_ids, right_mask, jax.random.key(0), SamplingParams(max_new_tokens=6, greedy=True))
    want_ids, want_log_probs = reference_greedy(tiny, left_ids, left_mask, 6)
    np.testing.assert_array_equal(np.asarray(out.response_ids), want_ids)
    np.testing.assert_allclose(np.asarray(out.log_probs), want_log_probs, atol=LOG_PROB_ATOL)


def expected_after_eos(tokens: np.ndarray, eos: set[int], pad: int) -> tuple[np.ndarray, np.ndarray]:
    mask = np.ones(tokens.shape, bool)
    for row in range(tokens.shape[0]):
        hits = [t for t in range(tokens.shape[1]) if tokens[row, t] in eos]
        if hits:
            mask[row, hits[0] + 1 :] = False
    return np.where(mask, tokens, pad), mask


def test_rows_stop_at_their_first_eos(tiny):
    prompt_ids, prompt_mask = pad_prompts(PROMPTS, pad_id=0, multiple=8)
    free_run, free_log_probs = reference_greedy(tiny, prompt_ids, prompt_mask, 6)
    # An EOS that some row emits mid-way; rows that never emit it must run to max_new_tokens.
    eos = {int(free_run[0, 2])}
    want_ids, want_mask = expected_after_eos(free_run, eos, pad=VOCAB - 1)
    assert want_mask.sum(axis=1).min() < 6, "precondition: some row stops early"
    params = SamplingParams(max_new_tokens=6, greedy=True, eos_token_ids=tuple(eos), pad_token_id=VOCAB - 1)
    out = generate(tiny, prompt_ids, prompt_mask, jax.random.key(0), params)
    np.testing.assert_array_equal(np.asarray(out.response_mask), want_mask)
    np.testing.assert_array_equal(np.asarray(out.response_ids), want_ids)
    np.testing.assert_allclose(np.asarray(out.log_probs), np.where(want_mask, free_log_probs, 0.0), atol=LOG_PROB_ATOL)


def test_loop_ends_when_every_row_has_finished(tiny):
    prompt_ids, prompt_mask = pad_prompts(PROMPTS, pad_id=0, multiple=8)
    first_tokens = reference_greedy(tiny, prompt_ids, prompt_mask, 1)[0][:, 0]
    params = SamplingParams(max_new_tokens=6, greedy=True, eos_token_ids=tuple(set(first_tokens.tolist())))
    out = generate(tiny, prompt_ids, prompt_mask, jax.random.key(0), params)
    np.testing.assert_array_equal(np.asarray(out.response_ids)[:, 0], first_tokens)
    np.testing.assert_array_equal(np.asarray(out.response_ids)[:, 1:], 0)
    np.testing.assert_array_equal(np.asarray(out.response_mask), np.tile(np.arange(6) == 0, (len(PROMPTS), 1)))
    np.testing.assert_array_equal(np.asarray(out.log_probs)[:, 1:], 0.0)


# ---------------------------------------------------------------------------------------------------------------
# Samples: layout, keys, filters, log-probs.


def test_n_samples_are_prompt_major(tiny):
    prompt_ids, prompt_mask = pad_prompts(PROMPTS, pad_id=0, multiple=8)
    greedy = reference_greedy(tiny, prompt_ids, prompt_mask, 6)[0]
    out = generate(tiny, prompt_ids, prompt_mask, jax.random.key(0), SamplingParams(6, greedy=True, n=3))
    np.testing.assert_array_equal(np.asarray(out.response_ids), np.repeat(greedy, 3, axis=0))
    np.testing.assert_array_equal(np.asarray(out.prompt_ids), np.repeat(prompt_ids, 3, axis=0))
    np.testing.assert_array_equal(np.asarray(out.prompt_mask), np.repeat(prompt_mask, 3, axis=0))


SAMPLED = SamplingParams(max_new_tokens=8, temperature=1.3, n=8)


def test_same_key_same_samples_other_key_other_samples(tiny):
    prompt_ids, prompt_mask = pad_prompts(PROMPTS, pad_id=0, multiple=8)
    first = generate(tiny, prompt_ids, prompt_mask, jax.random.key(1), SAMPLED)
    again = generate(tiny, prompt_ids, prompt_mask, jax.random.key(1), SAMPLED)
    other = generate(tiny, prompt_ids, prompt_mask, jax.random.key(2), SAMPLED)
    np.testing.assert_array_equal(np.asarray(first.response_ids), np.asarray(again.response_ids))
    assert (np.asarray(first.response_ids) != np.asarray(other.response_ids)).mean() > 0.5
    # The n samples of one prompt are different draws, not copies.
    groups = np.asarray(first.response_ids).reshape(len(PROMPTS), SAMPLED.n, -1)
    assert all(len({row.tobytes() for row in group}) > SAMPLED.n // 2 for group in groups)


# ---------------------------------------------------------------------------------------------------------------
# Continuous batching (max_num_seqs): the same rows as decoding all at once, without steps on finished rows.

# an empty prompt (a filler row gets an empty response) and EOS ids that end rows at different lengths
RAGGED_PROMPTS = [[3, 1, 4, 1, 5], [9, 2], [], [11], [2, 7, 1, 8, 2, 8]]
RAGGED = SamplingParams(max_new_tokens=10, temperature=1.1, n=3, eos_token_ids=(7, 9, 13))


def useful_decode_slots(out: RolloutBatch) -> int:
    """Row-steps that produced a token: every generated token but each row's first needs one forward pass."""
    lengths = np.asarray(out.response_mask).sum(axis=1)
    return int(np.maximum(lengths - 1, 0).sum())


def test_samples_reading_one_shared_prompt_block_equal_samples_with_a_copy_each(causal_lm):
    # n samples of a prompt attend to one prompt block; the same rows given a copy of the prompt each (n = 1 over
    # the repeated prompts) keep their row indices, hence their keys, and must sample the same tokens
    prompt_ids, prompt_mask = pad_prompts(RAGGED_PROMPTS, pad_id=0, multiple=8)
    shared = generate(causal_lm, prompt_ids, prompt_mask, jax.random.key(6), RAGGED)
    copied = generate(causal_lm, np.repeat(prompt_ids, RAGGED.n, axis=0), np.repeat(prompt_mask, RAGGED.n, axis=0),
                      jax.random.key(6), dataclasses.replace(RAGGED, n=1))
    np.testing.assert_array_equal(np.asarray(shared.response_ids), np.asarray(copied.response_ids))
    np.testing.assert_array_equal(np.asarray(shared.response_mask), np.asarray(copied.response_mask))
    np.testing.assert_allclose(np.asarray(shared.log_probs), np.asarray(copied.log_probs), atol=LOG_PROB_ATOL)


@pytest.mark.parametrize("max_num_seqs", [1, 4, 7])
def test_continuous_batching_gives_each_row_the_tokens_of_decoding_all_rows_at_once(model, max_num_seqs):
    prompt_ids, prompt_mask = pad_prompts(RAGGED_PROMPTS, pad_id=0, multiple=8)
    together = generate(model, prompt_ids, prompt_mask, jax.random.key(4), RAGGED)
    params = dataclasses.replace(RAGGED, max_num_seqs=max_num_seqs)
    slots = generate(model, prompt_ids, prompt_mask, jax.random.key(4), params)
    lengths = np.asarray(together.response_mask).sum(axis=1)
    assert len(set(lengths[lengths > 0])) > 2  # rows end at several lengths: slots are refilled mid-run
    for field in ("response_ids", "response_mask", "prompt_ids", "prompt_mask"):
        np.testing.assert_array_equal(np.asarray(getattr(slots, field)), np.asarray(getattr(together, field)))
    # a row's logits come from a gathered prompt block instead of the shared one: summation order only
    np.testing.assert_allclose(np.asarray(slots.log_probs), np.asarray(together.log_probs), atol=LOG_PROB_ATOL)


@pytest.mark.parametrize("max_num_seqs", [0, 4])
def test_responses_cached_in_small_blocks_equal_one_block(causal_lm, monkeypatch, max_num_seqs):
    # blocks of 2 slots: a step reads only the blocks some row can see; the tokens must not change, and the
    # log-probs only by the rounding of combining per-block softmax sums (rollout.cache_blocks 8 vs 1)
    params = dataclasses.replace(RAGGED, max_num_seqs=max_num_seqs, cache_blocks=1)
    prompt_ids, prompt_mask = pad_prompts(RAGGED_PROMPTS, pad_id=0, multiple=8)
    monkeypatch.setattr(layers, "MIN_RESPONSE_BLOCK", 2)
    make_generate_fn.cache_clear()  # the block sizes are read while tracing
    try:
        one_block = generate(causal_lm, prompt_ids, prompt_mask, jax.random.key(4), params)
        blocks = generate(causal_lm, prompt_ids, prompt_mask, jax.random.key(4),
                          dataclasses.replace(params, cache_blocks=8))
    finally:
        make_generate_fn.cache_clear()
    assert len(layers.response_blocks(RAGGED.max_new_tokens, 8)) == 5
    for field in ("response_ids", "response_mask"):
        np.testing.assert_array_equal(np.asarray(getattr(blocks, field)), np.asarray(getattr(one_block, field)))
    np.testing.assert_allclose(np.asarray(blocks.log_probs), np.asarray(one_block.log_probs), atol=LOG_PROB_ATOL)


def test_continuous_batching_spends_no_step_on_a_finished_row(tiny):
    prompt_ids, prompt_mask = pad_prompts(RAGGED_PROMPTS, pad_id=0, multiple=8)
    together = generate(tiny, prompt_ids, prompt_mask, jax.random.key(4), RAGGED)
    one_slot = generate(tiny, prompt_ids, prompt_mask, jax.random.key(4), dataclasses.replace(RAGGED, max_num_seqs=1))
    useful = useful_decode_slots(together)
    rows = len(RAGGED_PROMPTS) * RAGGED.n
    longest = int(np.asarray(together.response_mask).sum(axis=1).max())
    # all rows together: every row is decoded until the longest ends
    assert int(np.sum(together.decode_slots)) == (longest - 1) * rows > useful
    # one slot: one step per generated token after a row's first, plus one for each row that ends at its first
    # token (here the empty prompts' rows), whose slot is refilled at the next step
    ended_at_once = int((np.asarray(together.response_mask).sum(axis=1) <= 1).sum())
    assert int(np.sum(one_slot.decode_slots)) == useful + ended_at_once


def nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Bool [.., V]: the smallest most-likely set whose probability reaches top_p (float64 reference)."""
    order = np.argsort(-probs, axis=-1)
    sorted_probs = np.take_along_axis(probs, order, axis=-1)
    keep_sorted = np.cumsum(sorted_probs, axis=-1) - sorted_probs < top_p
    keep = np.zeros_like(keep_sorted)
    np.put_along_axis(keep, order, keep_sorted, axis=-1)
    return keep


@pytest.mark.parametrize(
    "model_name, params",
    [
        ("tiny", SamplingParams(max_new_tokens=8, temperature=1.0, top_k=3, n=8)),
        ("tiny", SamplingParams(max_new_tokens=8, temperature=0.7, top_p=0.6, n=8)),
        ("tiny", SamplingParams(max_new_tokens=8, temperature=1.3, top_k=6, top_p=0.8, n=8, eos_token_ids=(9,))),
        ("causal_lm", SamplingParams(max_new_tokens=8, temperature=1.2, top_k=5, top_p=0.9, n=4)),
    ],
    ids=["top_k", "top_p", "top_k_top_p_eos", "causal_lm"],
)
def test_sampled_tokens_obey_filters_and_log_probs_match_recomputation(request, model_name, params):
    model = request.getfixturevalue(model_name)
    prompt_ids, prompt_mask = pad_prompts(PROMPTS, pad_id=0, multiple=8)
    out = generate(model, prompt_ids, prompt_mask, jax.random.key(3), params)
    mask = np.asarray(out.response_mask)
    tokens = np.asarray(out.response_ids)
    logits = next_token_logits(model, out)
    want_log_probs = np.take_along_axis(log_softmax(logits, params.temperature), tokens[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(np.asarray(out.log_probs), np.where(mask, want_log_probs, 0.0), atol=LOG_PROB_ATOL)

    allowed = np.ones(logits.shape, bool)
    if params.top_k:
        kth_best = np.sort(logits, axis=-1)[..., -params.top_k]
        allowed &= logits >= kth_best[..., None]
    if params.top_p < 1:
        restricted = np.where(allowed, logits / params.temperature, -np.inf)
        probs = np.exp(log_softmax(restricted))
        # Widen by 1e-4 so float32 rounding at the nucleus boundary cannot flag a correct draw.
        allowed &= nucleus(probs, params.top_p + 1e-4)
    chosen_allowed = np.take_along_axis(allowed, tokens[..., None], axis=-1)[..., 0]
    assert chosen_allowed[mask].all()
    # The filter bites: many slots had forbidden tokens, so a sampler ignoring it would have been caught.
    assert (~allowed[mask]).sum() > mask.sum()
    if params.eos_token_ids:
        stopped = np.isin(tokens, params.eos_token_ids) & mask
        assert stopped.any() and not (mask[:, 1:] & np.cumsum(stopped, axis=1)[:, :-1].astype(bool)).any()


# ---------------------------------------------------------------------------------------------------------------
# Compilation buckets, mesh, bad input.


def test_prompt_lengths_in_one_bucket_share_a_compilation(tiny):
    graphdef, state = nnx.split(tiny)
    params = SamplingParams(max_new_tokens=3, greedy=True, pad_token_id=5)
    fn = make_generate_fn(graphdef, params)
    assert make_generate_fn(graphdef, params) is fn
    key = jax.random.key(0)
    short = pad_prompts([[1, 2, 3], [4]], pad_id=5, multiple=8)
    longer = pad_prompts([[1, 2, 3, 4, 5, 6, 7], [8, 9]], pad_id=5, multiple=8)
    np.testing.assert_array_equal(short[0], [[5] * 5 + [1, 2, 3], [5] * 7 + [4]])
    assert short[0].shape == longer[0].shape == (2, 8)
    fn(state, *short, key)
    fn(state, *longer, key)
    assert fn._cache_size() == 1
    # Another bucket compiles once more; an empty prompt (a filler row) gets an empty response.
    out = fn(state, *pad_prompts([list(range(1, 10)), []], pad_id=5, multiple=8), key)
    assert fn._cache_size() == 2 and out.prompt_ids.shape == (2, 16)
    np.testing.assert_array_equal(np.asarray(out.response_mask)[1], False)
    np.testing.assert_array_equal(np.asarray(out.response_ids)[1], 5)
    assert np.asarray(out.response_mask)[0].all()


def test_bucket_length():
    assert [bucket_length(p, multiple=8) for p in (0, 1, 8, 9, 16, 17)] == [8, 8, 8, 16, 16, 24]


# max_num_seqs 8: each of the 8 devices runs continuous batching on one slot of its own; 3 slots do not split over
# them, so the loop runs on the global rows
@pytest.mark.parametrize("max_num_seqs", [0, 3, 8])
@pytest.mark.parametrize("shape", [(4, 2, 1), (1, 2, 4)], ids=["data4xfsdp2", "fsdp2xsequence4"])
def test_rows_sharded_over_a_mesh_give_the_same_samples(causal_lm, max_num_seqs, shape):
    # on a sequence axis the sampler splits its rows over it too (each device decodes prompts of its own, in a
    # decoding loop of its own)
    prompts = PROMPTS + [[2, 7], [1, 1, 1], [5], [4, 4, 8, 1]]
    prompt_ids, prompt_mask = pad_prompts(prompts, pad_id=0, multiple=8)
    params = SamplingParams(max_new_tokens=8, temperature=1.3, top_k=8, n=2, max_num_seqs=max_num_seqs)
    want = generate(causal_lm, prompt_ids, prompt_mask, jax.random.key(5), params)
    mesh = make_mesh(data=shape[0], fsdp=shape[1], sequence=shape[2])
    with jax.set_mesh(mesh):
        graphdef, state = nnx.split(causal_lm)
        sharded = nnx.merge(graphdef, jax.device_put(state, param_shardings(state, mesh)))
        rows = jax.sharding.NamedSharding(mesh, batch_spec())
        got = generate(sharded, jax.device_put(prompt_ids, rows), jax.device_put(prompt_mask, rows),
                       jax.random.key(5), params)
    # the rows leave over data x fsdp, as every other batch (replicated over sequence)
    assert got.response_ids.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, batch_spec()), 2)
    # Random bits do not depend on the sharding, so the draws are the same; log-probs differ by rounding only.
    np.testing.assert_array_equal(np.asarray(got.response_ids), np.asarray(want.response_ids))
    np.testing.assert_allclose(np.asarray(got.log_probs), np.asarray(want.log_probs), atol=LOG_PROB_ATOL)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=4, top_p=0.0), "top_p"),
        (dict(max_new_tokens=4, top_p=1.5), "top_p"),
        (dict(max_new_tokens=4, top_k=-1), "top_k"),
        (dict(max_new_tokens=4, temperature=0.0), "temperature"),
        (dict(max_new_tokens=4, temperature=-1.0), "temperature"),
        (dict(max_new_tokens=4, n=0), "n"),
        (dict(max_new_tokens=2.5), "max_new_tokens"),
        (dict(max_new_tokens=4, max_num_seqs=-1), "max_num_seqs"),
    ],
)
def test_bad_sampling_params_are_named(kwargs, name):
    with pytest.raises(ValueError, match=f"SamplingParams.{name}="):
        SamplingParams(**kwargs)


def test_greedy_accepts_zero_temperature():
    assert SamplingParams(max_new_tokens=1, temperature=0.0, greedy=True).temperature == 0.0


@pytest.mark.parametrize(
    "ids_shape, mask_shape, params, message",
    [
        ((2, 8), (2, 7), SamplingParams(2), r"prompt_ids \(2, 8\) and prompt_mask \(2, 7\)"),
        ((8,), (8,), SamplingParams(2), r"prompt_ids \(8,\)"),
        ((2, 8), (2, 8), SamplingParams(2, eos_token_ids=(VOCAB,)), "eos_token_ids=.*vocabulary of size 16"),
        ((2, 8), (2, 8), SamplingParams(2, pad_token_id=VOCAB + 3), "pad_token_id=.*vocabulary of size 16"),
    ],
)
def test_bad_inputs_fail_while_tracing(tiny, ids_shape, mask_shape, params, message):
    graphdef, state = nnx.split(tiny)
    # An error from trace() comes before lowering and compilation.
    with pytest.raises(ValueError, match=message):
        make_generate_fn(graphdef, params).trace(
            state, jnp.zeros(ids_shape, jnp.int32), jnp.ones(mask_shape, bool), jax.random.key(0)
        )
    with pytest.raises(ValueError, match=message):
        generate(tiny, np.zeros(ids_shape, np.int32), np.ones(mask_shape, bool), jax.random.key(0), params)


def test_pad_prompts_rejects_overlong_prompt():
    with pytest.raises(ValueError, match="prompt 1 has 5 tokens, more than the padded length 4"):
        pad_prompts([[1], [1, 2, 3, 4, 5]], pad_id=0, length=4)
