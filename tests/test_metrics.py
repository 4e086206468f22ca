"""Metric pairs: combined over pieces (micro-batches) and mesh shards, finished once, averaged over steps.

Expected values are computed by hand / numpy on the same small arrays. float32 arithmetic on a handful of values
of order 1: rtol 1e-6.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jppo.core import metrics as metrics_lib
from jppo.core.masked import NormStats, global_norm_stats
from jppo.core.metrics import Metric

RTOL = 1e-6

VALUES = np.array([[1.0, 2.0, np.nan], [-4.0, np.inf, 6.0], [np.nan, np.nan, np.nan], [-7.0, 0.5, -np.inf]], np.float32)
MASK = np.array([[1, 1, 0], [1, 0, 1], [0, 0, 0], [1, 1, 0]], bool)
VALID = VALUES[MASK]  # [1, 2, -4, 6, -7, 0.5]


def metrics_of(values, mask, share, norm):
    return {
        "ratio": metrics_lib.ratio(values, mask),
        "loss": metrics_lib.loss_share(share, mask, norm),
        "value_max": metrics_lib.maximum(values, mask),
        "value_min": metrics_lib.minimum(values, mask),
    }


def piece_metrics(rows, share, norm):
    return metrics_of(jnp.asarray(VALUES[rows]), jnp.asarray(MASK[rows]), jnp.float32(share), norm)


def test_pieces_reduce_to_whole_batch_values_with_nan_and_empty_pieces():
    norm = NormStats(jnp.float32(MASK.sum()), jnp.float32(3), jnp.float32(1))
    # shares of a token-sum "loss" equal to the sum of the valid values of each piece
    pieces = [
        piece_metrics(slice(0, 1), share=3.0, norm=norm),
        piece_metrics(slice(1, 1), share=0.0, norm=norm),  # no rows at all
        piece_metrics(slice(2, 3), share=0.0, norm=norm),  # one fully masked row, all NaN
        piece_metrics(slice(1, 2), share=2.0, norm=norm),
        piece_metrics(slice(3, 4), share=-6.5, norm=norm),
    ]
    reduced = metrics_lib.reduce(pieces)
    assert np.allclose(float(reduced["ratio"]), VALID.mean(), rtol=RTOL)
    assert np.allclose(float(reduced["loss"]), VALID.sum(), rtol=RTOL)  # weights n_piece / N sum to 1
    assert float(reduced["value_max"]) == 6.0
    assert float(reduced["value_min"]) == -7.0
    whole = metrics_lib.finish(piece_metrics(slice(0, 4), share=float(VALID.sum()), norm=norm))
    for name in reduced:
        assert np.allclose(float(reduced[name]), float(whole[name]), rtol=RTOL), name


def test_loss_share_with_own_counts_reports_the_mean_of_non_empty_pieces():
    """Each piece normalized by its own counts (legacy per-micro-batch): a non-empty piece weighs 1, an empty one 0."""
    pieces = [
        piece_metrics(rows, share, global_norm_stats(jnp.asarray(MASK[rows])))
        for rows, share in ((slice(0, 1), 2.0), (slice(2, 3), 0.0), (slice(3, 4), 5.0))
    ]
    assert np.allclose(float(metrics_lib.reduce(pieces)["loss"]), 3.5, rtol=RTOL)


def test_extremes_ignore_pieces_without_data():
    """A piece without data must not win a max/min, whatever its numerator holds."""
    negatives = {"x_max": Metric(jnp.float32(-3.0), jnp.float32(2)), "x_min": Metric(jnp.float32(4.0), jnp.float32(2))}
    junk = {"x_max": Metric(jnp.float32(1e9), jnp.float32(0)), "x_min": Metric(jnp.float32(-1e9), jnp.float32(0))}
    for pieces in ([negatives, junk], [junk, negatives]):
        reduced = metrics_lib.reduce(pieces)
        assert float(reduced["x_max"]) == -3.0 and float(reduced["x_min"]) == 4.0
    nothing = metrics_lib.reduce([junk, junk])
    assert float(nothing["x_max"]) == 0.0 and float(nothing["x_min"]) == 0.0


def test_integer_extremes():
    lengths = jnp.array([[3, 9], [5, 1]], jnp.int32)
    mask = jnp.array([[True, False], [True, True]])
    reduced = metrics_lib.reduce(
        [{"len_max": metrics_lib.maximum(lengths[:1], mask[:1]), "len_min": metrics_lib.minimum(lengths[:1], mask[:1])},
         {"len_max": metrics_lib.maximum(lengths[1:], mask[1:]), "len_min": metrics_lib.minimum(lengths[1:], mask[1:])}]
    )
    assert int(reduced["len_max"]) == 5 and int(reduced["len_min"]) == 1


def test_finish_without_data_is_zero_not_nan():
    finished = metrics_lib.finish({"ratio": Metric(jnp.float32(0), jnp.float32(0))})
    assert float(finished["ratio"]) == 0.0


def test_scalar_metric_is_its_value():
    assert float(metrics_lib.reduce([{"lr": metrics_lib.scalar(0.5)}, {"lr": metrics_lib.scalar(0.5)}])["lr"]) == 0.5


def test_combine_rejects_mismatched_keys():
    a = {"actor/pg_loss": metrics_lib.scalar(1.0)}
    b = {"actor/pg_lossx": metrics_lib.scalar(1.0)}
    with pytest.raises(ValueError, match="actor/pg_lossx"):
        metrics_lib.combine(a, b)


def test_combine_all_of_nothing_is_empty():
    assert metrics_lib.combine_all([]) == {} and metrics_lib.reduce([]) == {}


def test_psum_over_shards_equals_the_whole_batch():
    """Rows split over 4 devices; one shard holds only a fully masked NaN row."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    # integer lengths under the mask: 2, 7, 4, 1, 3, 3; the masked 100s must not win the max
    lengths = np.array([[2, 7, 100], [4, 100, 1], [100, 100, 100], [3, 3, 100]], np.int32)

    def per_shard(values, mask, lengths):
        norm = NormStats(jax.lax.psum(jnp.sum(mask, dtype=jnp.float32), "data"), jnp.float32(1), jnp.float32(1))
        share = jnp.sum(jnp.where(mask, values, 0))  # this shard's token-sum
        metrics = metrics_of(values, mask, share, norm) | {
            "len_max": metrics_lib.maximum(lengths, mask),
            "len_min": metrics_lib.minimum(lengths, mask),
        }
        return metrics_lib.psum(metrics, "data")

    summed = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=P("data"), out_specs=P()))(VALUES, MASK, lengths)
    finished = metrics_lib.finish(summed)
    assert np.allclose(float(finished["ratio"]), VALID.mean(), rtol=RTOL)
    assert np.allclose(float(finished["loss"]), VALID.sum(), rtol=RTOL)
    assert float(finished["value_max"]) == 6.0 and float(finished["value_min"]) == -7.0
    assert int(finished["len_max"]) == 7 and int(finished["len_min"]) == 1


def test_mean_over_steps_by_name():
    steps = [
        {"actor/pg_loss": 1.0, "response_length_max": 3.0, "response_length_min": 2.0},
        {"actor/pg_loss": 3.0, "response_length_max": 5.0, "response_length_min": 1.0, "critic/vf_loss": 4.0},
        {"actor/pg_loss": 5.0, "response_length_max": 4.0, "response_length_min": 6.0},
    ]
    assert metrics_lib.mean_over_steps(steps) == {
        "actor/pg_loss": 3.0,
        "critic/vf_loss": 4.0,  # present in one step only: the mean over the steps that have it
        "response_length_max": 5.0,
        "response_length_min": 1.0,
    }
    assert metrics_lib.mean_over_steps([]) == {}


@pytest.mark.parametrize("cut", [(8,), (3, 0, 5), (1, 1, 1, 1, 4)])
def test_explained_variance_of_the_pieces_is_the_whole_batch_one(cut):
    """Formed once from the summed moments, it equals ``1 - Var(t - p) / Var(t)`` over the whole batch's valid
    tokens (numpy, float64), whatever the cut; NaN under the mask stays out. float32 moments of O(1) values: the
    difference of second moments loses a few digits, hence rtol 1e-5."""
    rng = np.random.default_rng(3)
    targets = rng.normal(size=(8, 5)).astype(np.float32)
    predictions = (targets + rng.normal(scale=0.5, size=(8, 5))).astype(np.float32)
    mask = rng.random((8, 5)) > 0.3
    mask[2] = False
    targets[~mask], predictions[~mask] = np.nan, np.inf
    bounds = np.cumsum((0,) + cut)
    pieces = [
        {"critic/vf_explained_var": metrics_lib.explained_variance(
            jnp.asarray(targets[a:b]), jnp.asarray(predictions[a:b]), jnp.asarray(mask[a:b]))}
        for a, b in zip(bounds[:-1], bounds[1:])
    ]
    value = float(metrics_lib.reduce(pieces)["critic/vf_explained_var"])
    t, p = targets[mask].astype(np.float64), predictions[mask].astype(np.float64)
    np.testing.assert_allclose(value, 1 - np.var(t - p) / np.var(t), rtol=1e-5)


# XLA's CPU options as a user's run has them (the suite compiles at the lowest level: tests/conftest.py)
USER_OPTIMIZATION = {"xla_backend_optimization_level": 3, "xla_llvm_disable_expensive_passes": False}


@pytest.mark.parametrize("cut", [(3,), (1, 2), (1, 1, 1)])
def test_explained_variance_of_one_token_is_zero_in_every_compiled_cut(cut):
    """A mini-batch a rejection leaves one valid token of: its targets do not vary, so the explained variance is 0
    for every cut, compiled as a user's run compiles it (XLA's default optimization level, not the suite's lowest:
    summed second moments finished as ``E[t^2] - E[t]^2`` gave a fused multiply-add's rounding residue over
    another there, 0.82 for this token, and 0 at the lowest level)."""
    targets = jnp.asarray([[2.118803024291992, 0.0], [0.0, 0.0], [0.0, 0.0]], jnp.float32)
    predictions = jnp.asarray([[0.1234567, 0.0], [0.0, 0.0], [0.0, 0.0]], jnp.float32)
    mask = jnp.asarray([[True, False], [False, False], [False, False]])
    bounds = np.cumsum((0,) + cut)

    def whole(t, p, m):
        return metrics_lib.reduce([
            {"critic/vf_explained_var": metrics_lib.explained_variance(t[a:b], p[a:b], m[a:b])}
            for a, b in zip(bounds[:-1], bounds[1:])
        ])["critic/vf_explained_var"]

    compiled = jax.jit(whole).lower(targets, predictions, mask).compile(compiler_options=USER_OPTIMIZATION)
    assert float(compiled(targets, predictions, mask)) == 0.0


def test_explained_variance_keeps_a_small_spread_beside_a_large_mean():
    """Targets of mean 300 and spread 0.05, in float32 pieces of every size: the merged deviations keep the
    whole batch's value (numpy, float64) where summed second moments cancel to noise (E[t^2] = 9e4, its rounding
    5e-3 beside Var(t) = 2.5e-3)."""
    rng = np.random.default_rng(5)
    targets = (300 + rng.normal(scale=0.05, size=(16, 4))).astype(np.float32)
    predictions = (targets + rng.normal(scale=0.02, size=(16, 4))).astype(np.float32)
    mask = rng.random((16, 4)) > 0.2
    t, p = targets[mask].astype(np.float64), predictions[mask].astype(np.float64)
    expected = 1 - np.var(t - p) / np.var(t)
    for size in (1, 3, 16):
        pieces = [{"critic/vf_explained_var": metrics_lib.explained_variance(
            jnp.asarray(targets[a:a + size]), jnp.asarray(predictions[a:a + size]), jnp.asarray(mask[a:a + size]))}
            for a in range(0, 16, size)]
        value = float(jax.jit(metrics_lib.reduce)(pieces)["critic/vf_explained_var"])
        np.testing.assert_allclose(value, expected, atol=1e-3)


def test_explained_variance_over_shards_is_the_whole_batch_one():
    """Under shard_map: every shard's deviations merged (one shard's rows fully masked)."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    rng = np.random.default_rng(7)
    targets = rng.normal(size=(8, 3)).astype(np.float32)
    predictions = (targets + rng.normal(scale=0.5, size=(8, 3))).astype(np.float32)
    mask = rng.random((8, 3)) > 0.3
    mask[4:6] = False

    def per_shard(t, p, m):
        return metrics_lib.psum({"x_explained_var": metrics_lib.explained_variance(t, p, m)}, "data")

    merged = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=P("data"), out_specs=P()))(
        targets, predictions, mask)
    t, p = targets[mask].astype(np.float64), predictions[mask].astype(np.float64)
    np.testing.assert_allclose(float(metrics_lib.finish(merged)["x_explained_var"]),
                               1 - np.var(t - p) / np.var(t), rtol=1e-5)


def test_explained_variance_is_zero_for_constant_targets_or_no_data():
    ones = jnp.ones((2, 3))
    constant = metrics_lib.explained_variance(ones, ones * 0.5, jnp.ones((2, 3), bool))
    empty = metrics_lib.explained_variance(ones, ones, jnp.zeros((2, 3), bool))
    finished = metrics_lib.finish({"a_explained_var": constant, "b_explained_var": empty})
    assert float(finished["a_explained_var"]) == 0.0 and float(finished["b_explained_var"]) == 0.0
