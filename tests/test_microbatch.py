"""Host-side micro-batching: both cuts carry every response token to the right place, and only there."""

import jax
import numpy as np
import pytest

from jppo.core.experience import Experience
from jppo.engine.microbatch import (
    fixed_micro_batches,
    make_micro_batches,
    next_power_of_two,
    packed_micro_batches,
    scatter_back,
    stack_micro_batches,
)


def random_batch(seed: int, n: int = 16, p: int = 6, length: int = 7) -> Experience:
    """Ragged left-padded prompts; ragged responses incl. empty ones; loss-mask holes inside some responses."""
    rng = np.random.default_rng(seed)
    prompt_len = rng.integers(1, p + 1, n)
    prompt_mask = np.arange(p)[None, :] >= (p - prompt_len)[:, None]
    prompt_ids = np.where(prompt_mask, rng.integers(1, 100, (n, p)), 0)
    response_len = rng.integers(0, length + 1, n)
    attention = np.arange(length)[None, :] < response_len[:, None]
    holes = rng.random((n, length)) < 0.2
    last = np.zeros_like(attention)
    last[np.arange(n), np.maximum(response_len - 1, 0)] = response_len > 0
    response_mask = attention & (~holes | last)  # the last token stays a loss token, so attention is recoverable
    response_ids = np.where(attention, rng.integers(1, 100, (n, length)), 0)
    per_token = {"advantages": rng.normal(size=(n, length)), "old_log_prob": -rng.random((n, length))}
    return Experience(prompt_ids, prompt_mask, response_ids, response_mask, attention, **per_token)


def next_token_at_slots(micro) -> np.ndarray:
    k, d, r, w = micro.input_ids.shape
    flat = micro.input_ids.reshape(k, d, r * w)
    following = np.concatenate([flat[..., 1:], np.zeros_like(flat[..., :1])], axis=-1)
    picked = np.take_along_axis(following, micro.gather_index.reshape(k, d, -1), axis=-1)
    return picked.reshape(micro.gather_index.shape)


CUTS = [
    ("fixed", dict(micro_batch_size=1)),
    ("fixed", dict(micro_batch_size=2)),
    ("fixed", dict(micro_batch_size=4)),
    ("packed", dict(max_token_len=13)),
    ("packed", dict(max_token_len=40)),
]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("shards", [1, 2, 4])
@pytest.mark.parametrize("kind,kwargs", CUTS)
def test_gather_index_points_at_the_position_predicting_each_response_token(seed, shards, kind, kwargs):
    batch = random_batch(seed)
    micro = make_micro_batches(batch, shards, **kwargs)
    predicted = scatter_back(next_token_at_slots(micro), micro.row_ids, batch.num_sequences)
    attention = batch.response_attention
    np.testing.assert_array_equal(np.where(attention, predicted, 0), batch.response_ids)
    for name in ("advantages", "old_log_prob"):
        back = scatter_back(getattr(micro.slots, name), micro.row_ids, batch.num_sequences)
        np.testing.assert_array_equal(back, getattr(batch, name))
    assert jax.tree.structure(micro.slots) == jax.tree.structure(batch.per_token())  # every per-token field, no other
    back_mask = scatter_back(micro.slots.response_mask, micro.row_ids, batch.num_sequences)
    np.testing.assert_array_equal(back_mask, batch.response_mask)
    # every sequence sits in exactly one slot, on the shard that owns its row
    rows = micro.row_ids[micro.row_ids >= 0]
    np.testing.assert_array_equal(np.sort(rows), np.arange(batch.num_sequences))
    per_shard = batch.num_sequences // shards
    for d in range(shards):
        owned = micro.row_ids[:, d][micro.row_ids[:, d] >= 0]
        assert np.all(owned // per_shard == d)


@pytest.mark.parametrize("seed", [0, 3])
def test_packed_rows_respect_budget_segments_and_positions(seed):
    batch = random_batch(seed, n=24)
    budget = 15
    micro = packed_micro_batches(batch, 2, budget)
    k, d, r, w = micro.input_ids.shape
    assert (r, w) == (1, budget)
    assert k == next_power_of_two(k) and micro.row_ids.shape[2] == next_power_of_two(micro.row_ids.shape[2])
    lengths = batch.lengths()
    for kk in range(k):
        for dd in range(d):
            seg = micro.segment_ids[kk, dd, 0]
            pos = micro.positions[kk, dd, 0]
            for slot, row in enumerate(micro.row_ids[kk, dd]):
                where = np.flatnonzero(seg == slot + 1)
                if row < 0:
                    assert where.size == 0
                    assert not micro.slots.response_mask[kk, dd, slot].any()
                    continue
                assert where.size == lengths[row]
                np.testing.assert_array_equal(where, where[0] + np.arange(where.size))  # contiguous
                np.testing.assert_array_equal(pos[where], np.arange(where.size))  # positions restart
            np.testing.assert_array_equal(micro.input_ids[kk, dd, 0][seg == 0], 0)


def test_fixed_rows_keep_left_padding_and_positions():
    batch = random_batch(5, n=8)
    micro = fixed_micro_batches(batch, 2, 2)
    k, d, r, w = micro.input_ids.shape
    assert (k, d, r, w) == (2, 2, 2, 6 + 7)
    for kk in range(k):
        for dd in range(d):
            for slot in range(r):
                row = micro.row_ids[kk, dd, slot]
                real = np.concatenate([batch.prompt_mask[row], batch.response_attention[row]])
                np.testing.assert_array_equal(micro.segment_ids[kk, dd, slot], real.astype(np.int32))
                np.testing.assert_array_equal(micro.positions[kk, dd, slot][real], np.arange(real.sum()))


def test_every_shard_runs_the_same_number_of_micro_batches():
    batch = random_batch(7, n=16)
    # Make shard 0 hold only long sequences: it needs more packed rows than shard 1.
    lengths = batch.lengths()
    order = np.argsort(-lengths, kind="stable")
    micro = packed_micro_batches(batch.take(order), 2, 14)
    assert micro.input_ids.shape[1] == 2
    used = (micro.row_ids >= 0).any(-1)  # [K, D]
    assert used[:, 0].sum() > used[:, 1].sum()  # shard 1 pads with empty micro-batches


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(micro_batch_size=3), "cannot be cut into micro-batches of 3"),
        (dict(micro_batch_size=16), "larger than the 8 sequences"),
        (dict(micro_batch_size=0), "micro_batch_size must be >= 1"),
        (dict(max_token_len=4), "ppo_max_token_len=4 is smaller than the longest sequence"),
        (dict(), "exactly one of"),
    ],
)
def test_bad_cuts_raise_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_micro_batches(random_batch(0), 2, **kwargs)


def test_rows_must_split_evenly_over_shards_and_shapes_must_agree():
    batch = random_batch(0, n=6)
    with pytest.raises(ValueError, match="6 sequences cannot be split evenly over 4"):
        fixed_micro_batches(batch, 4, 1)
    with pytest.raises(ValueError, match="response_mask has shape"):
        Experience(batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask[:, :3])
    with pytest.raises(ValueError, match="per-token array 'advantages'"):
        Experience(batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask,
                   advantages=np.zeros((6, 2)))
    empty_prompt = batch.prompt_mask.copy()
    empty_prompt[0] = False
    with pytest.raises(ValueError, match="at least one prompt token"):
        Experience(batch.prompt_ids, empty_prompt, batch.response_ids, batch.response_mask)


def test_default_attention_runs_to_the_last_loss_token():
    mask = np.array([[1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]], bool)
    batch = Experience(np.ones((3, 2), int), np.ones((3, 2), bool), np.ones((3, 4), int), mask)
    np.testing.assert_array_equal(batch.response_attention, [[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]])


def test_stacked_steps_pad_to_a_common_shape_with_empty_micro_batches_and_slots():
    batch = random_batch(11, n=16)
    short = np.argsort(batch.lengths(), kind="stable")
    # the same budget, so rows agree; the short half packs into fewer micro-batches than the long half
    steps = [packed_micro_batches(batch.take(short[:8]), 2, 13), packed_micro_batches(batch.take(short[8:]), 2, 13)]
    assert (steps[0].input_ids.shape[0] != steps[1].input_ids.shape[0]
            or steps[0].row_ids.shape[2] != steps[1].row_ids.shape[2])
    stacked = stack_micro_batches(steps)
    k = max(s.input_ids.shape[0] for s in steps)
    slots = max(s.row_ids.shape[2] for s in steps)
    assert stacked.input_ids.shape[:2] == (2, k) and stacked.row_ids.shape == (2, k, 2, slots)
    for i, step in enumerate(steps):
        kk, _, ss = step.row_ids.shape
        np.testing.assert_array_equal(stacked.row_ids[i, :kk, :, :ss], step.row_ids)
        assert (stacked.row_ids[i, kk:] == -1).all() and (stacked.row_ids[i, :, :, ss:] == -1).all()
        mask = stacked.slots.response_mask
        assert not mask[i, kk:].any() and not mask[i, :, :, ss:].any()
        assert not stacked.segment_ids[i, kk:].any()


def test_a_right_padded_prompt_or_a_gap_in_the_response_is_refused():
    """The fixed layout reads response token j's prediction at column P - 1 + j: both would shift it silently."""
    ids = np.ones((2, 3), np.int32)
    left = np.array([[0, 1, 1], [1, 1, 1]], bool)
    response = np.array([[1, 1, 0], [1, 0, 0]], bool)
    Experience(ids, left, ids, response)  # left-padded, contiguous: fine
    with pytest.raises(ValueError, match="prompt_mask row 0 is not left-padded"):
        Experience(ids, np.array([[1, 1, 0], [1, 1, 1]], bool), ids, response)
    with pytest.raises(ValueError, match="response_attention row 1 has a gap"):
        Experience(ids, left, ids, np.array([[1, 0, 0], [1, 0, 1]], bool),
                      response_attention=np.array([[1, 0, 0], [1, 0, 1]], bool))
    # a hole in the loss mask alone is allowed (tool observations): attention defaults to the contiguous prefix
    holed = Experience(ids, left, ids, np.array([[1, 0, 1], [1, 0, 0]], bool))
    np.testing.assert_array_equal(holed.response_attention, [[1, 1, 1], [1, 0, 0]])
