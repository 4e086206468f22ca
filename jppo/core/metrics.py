"""Metrics as (numerator, denominator) pairs: summed over micro-batches and shards, divided once.

A metric reported by jppo is a whole-mini-batch value: it must not change when only the micro-batch size,
token-budget packing or the mesh changes. Averaging per-micro-batch means breaks that (the mean of means depends
on the cut), so every metric travels as a :class:`Metric` pair and is divided only at the end:

- a token ratio (clip fraction, approximate KL, mean value prediction) is ``(sum_t m v, sum_t m)``;
- a loss term is ``(share, n_local / N)``: the shares sum to the whole objective and the weights sum to 1;
- a maximum / minimum (keys ending in ``_max`` / ``_min``) is combined with ``max`` / ``min`` instead of ``+``;
- an explained variance (keys ending in ``_explained_var``) carries each piece's token count, means and sums of
  squared deviations, merged exactly (Chan et al.'s pairwise update), and is formed once from the whole
  mini-batch's;
- an expert load (keys ending in ``expert_load``) carries the tokens routed to each expert of each layer, added,
  and finishes as the largest ``max / mean`` over experts of a layer.

Across several optimizer steps (mini-batches, epochs) the finished values are averaged per step
(:func:`mean_over_steps`), again with ``_max`` / ``_min`` keys combined by name.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import struct

from jppo.core.masked import NormStats, masked_sum, safe_divide

Array = jax.Array
Metrics = dict[str, "Metric"]


@struct.dataclass
class Metric:
    """A metric before its final division. ``denominator`` 0 means "no data" and finishes as 0."""

    numerator: Array
    denominator: Array


def _kind(name: str) -> str:
    if name.endswith("_max"):
        return "max"
    if name.endswith("_min"):
        return "min"
    if name.endswith("_explained_var"):
        return "explained_var"
    if name.endswith("expert_load"):
        return "expert_load"
    return "sum"


def _adds(kind: str) -> bool:
    """Pieces of a sum or an expert load combine by adding numerators and denominators."""
    return kind in ("sum", "expert_load")


def ratio(values: Array, mask: Array) -> Metric:
    """Token-weighted mean of ``values`` under ``mask`` (NaN under the mask is ignored)."""
    dtype = values.dtype if jnp.issubdtype(values.dtype, jnp.floating) else jnp.float32
    return Metric(masked_sum(values.astype(dtype), mask), jnp.sum(mask.astype(bool), dtype=dtype))


def loss_share(share: Array, mask: Array, norm: NormStats) -> Metric:
    """A loss term's share, weighted so that the finished metric is the whole-mini-batch objective.

    The weight of a piece is its fraction of the mini-batch's valid tokens, ``n_local / N``; the weights of all
    pieces sum to 1. ``norm`` is the one the share was aggregated with. Given a piece's own counts (one call over
    the whole batch, or the legacy per-micro-batch mode) the weight is 1 for any non-empty piece, which reports
    the mean of the pieces' own values.
    """
    local_tokens = jnp.sum(mask.astype(bool), dtype=share.dtype)
    return Metric(share, safe_divide(local_tokens, norm.num_tokens.astype(share.dtype)))


def _sentinel(dtype: jnp.dtype, kind: str) -> Array:
    """The value that never wins a max (``kind="max"``) or a min: the dtype's lowest / highest, float or integer."""
    info = jnp.finfo(dtype) if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype)
    return jnp.asarray(info.min if kind == "max" else info.max, dtype)


def maximum(values: Array, mask: Array) -> Metric:
    """Largest value under ``mask``; report it under a key ending in ``_max``."""
    low = _sentinel(values.dtype, "max")
    return Metric(
        jnp.max(jnp.where(mask.astype(bool), values, low), initial=low), jnp.sum(mask.astype(bool), dtype=jnp.float32)
    )


def minimum(values: Array, mask: Array) -> Metric:
    """Smallest value under ``mask``; report it under a key ending in ``_min``."""
    high = _sentinel(values.dtype, "min")
    return Metric(
        jnp.min(jnp.where(mask.astype(bool), values, high), initial=high), jnp.sum(mask.astype(bool), dtype=jnp.float32)
    )


def explained_variance(targets: Array, predictions: Array, mask: Array) -> Metric:
    """``1 - Var(t - p) / Var(t)`` over the valid tokens of the whole mini-batch; report it under a key ending in
    ``_explained_var``.

    A variance is not a sum over pieces, and ``E[x^2] - E[x]^2`` of summed moments is no fit either: it cancels to
    rounding where the spread is small beside the mean, and for a single token (a mini-batch a rejection leaves one
    token of) it is ``fl(t^2) - t * t``, which a compiler's fused multiply-add turns into a rounding residue that
    differs between programs. Each piece carries its count ``n`` (the denominator) and, for ``d = t - p`` and
    ``t``, the mean and the sum of squared deviations from it, ``[mean d, M2 d, mean t, M2 t]`` (two passes over
    the piece: one token has ``M2 = 0`` exactly); :func:`combine` merges pieces exactly (:func:`_merge_moments`).
    Inputs may be NaN where ``mask`` is 0.
    """
    valid = mask.astype(bool)
    dtype = jnp.promote_types(targets.dtype, jnp.float32)
    count = jnp.sum(valid, dtype=dtype)
    t = jnp.where(valid, targets, 0).astype(dtype)
    d = jnp.where(valid, targets - predictions, 0).astype(dtype)

    def mean_and_m2(x):
        mean = safe_divide(jnp.sum(x), count)
        return mean, jnp.sum(jnp.where(valid, jnp.square(x - mean), 0))

    return Metric(jnp.stack([*mean_and_m2(d), *mean_and_m2(t)]), count)


def _merge_moments(a: Metric, b: Metric) -> Metric:
    """Two pieces' ``[mean, M2]`` pairs as one's (Chan, Golub and LeVeque): with ``n = n_a + n_b`` and
    ``delta = mean_b - mean_a``, ``mean = mean_a + delta n_b / n`` and ``M2 = M2_a + M2_b + delta^2 n_a n_b / n``.
    A piece without tokens leaves the other exactly as it is."""
    count = a.denominator + b.denominator
    share = safe_divide(b.denominator, count)  # n_b / n: exactly 1 or 0 next to an empty piece
    delta = b.numerator[0::2] - a.numerator[0::2]
    mean = a.numerator[0::2] + delta * share
    m2 = a.numerator[1::2] + b.numerator[1::2] + jnp.square(delta) * a.denominator * share
    return Metric(jnp.stack([mean, m2], axis=-1).reshape(-1), count)


# Targets whose spread is below this many units of float rounding of their mean do not vary: a variance that
# small is what rounding the mean leaves, and 1 - Var(d) / Var(t) of it would be noise.
RESOLUTION = 256


def _finish_explained_variance(metric: Metric) -> Array:
    count = metric.denominator
    mean_t, var_d, var_t = metric.numerator[2], *safe_divide(metric.numerator[1::2], count)
    floor = jnp.square(RESOLUTION * jnp.finfo(var_t.dtype).eps * mean_t)
    varies = (count > 0) & (var_t > floor)
    return jnp.where(varies, 1 - var_d / jnp.where(varies, var_t, 1), 0)


def scalar(value: Array | float) -> Metric:
    """A value that is already whole-batch (a learning rate, a gradient norm): weight 1."""
    value = jnp.asarray(value)
    return Metric(value, jnp.ones((), value.dtype if jnp.issubdtype(value.dtype, jnp.floating) else jnp.float32))


def _combine_one(name: str, a: Metric, b: Metric) -> Metric:
    kind = _kind(name)
    if _adds(kind):
        return Metric(a.numerator + b.numerator, a.denominator + b.denominator)
    if kind == "explained_var":
        return _merge_moments(a, b)
    pick = jnp.maximum if kind == "max" else jnp.minimum
    # A piece without data (denominator 0) must not win the max/min with its sentinel value.
    numerator = jnp.where(
        a.denominator == 0, b.numerator, jnp.where(b.denominator == 0, a.numerator, pick(a.numerator, b.numerator))
    )
    return Metric(numerator, a.denominator + b.denominator)


def combine(a: Mapping[str, Metric], b: Mapping[str, Metric]) -> Metrics:
    """Key-wise combination of two metric dicts with the same keys (sum, or max/min by name)."""
    if set(a) != set(b):
        raise ValueError(f"cannot combine metrics with different keys: {sorted(set(a) ^ set(b))}")
    return {name: _combine_one(name, a[name], b[name]) for name in a}


def combine_all(pieces: Iterable[Mapping[str, Metric]]) -> Metrics:
    """Combines the metrics of several pieces (micro-batches) of one mini-batch."""
    pieces = list(pieces)
    if not pieces:
        return {}
    total = dict(pieces[0])
    for piece in pieces[1:]:
        total = combine(total, piece)
    return total


def psum(metrics: Mapping[str, Metric], axis_name: str | Sequence[str]) -> Metrics:
    """Combines metrics over mesh axes inside ``jax.shard_map`` (sum, or max/min by name)."""
    out = {}
    for name, metric in metrics.items():
        kind = _kind(name)
        if kind == "explained_var":  # every shard's piece in its own slot (a sum of zeros is exact), merged in order
            size, index = jax.lax.psum(1, axis_name), jax.lax.axis_index(axis_name)
            piece = jnp.concatenate([metric.numerator, metric.denominator[None]])
            pieces = jax.lax.psum(jnp.zeros((size, piece.shape[0]), piece.dtype).at[index].set(piece), axis_name)
            merged = Metric(pieces[0, :-1], pieces[0, -1])
            for i in range(1, size):
                merged = _merge_moments(merged, Metric(pieces[i, :-1], pieces[i, -1]))
            out[name] = merged
            continue
        denominator = jax.lax.psum(metric.denominator, axis_name)
        if _adds(kind):
            numerator = jax.lax.psum(metric.numerator, axis_name)
        else:
            sentinel = _sentinel(metric.numerator.dtype, kind)
            masked = jnp.where(metric.denominator == 0, sentinel, metric.numerator)
            numerator = (jax.lax.pmax if kind == "max" else jax.lax.pmin)(masked, axis_name)
        out[name] = Metric(numerator, denominator)
    return out


def finish(metrics: Mapping[str, Metric]) -> dict[str, Array]:
    """Divides once: ``numerator / denominator`` for sums, the extreme itself for max/min, the explained variance
    from its moments; 0 where there is no data."""
    out = {}
    for name, metric in metrics.items():
        kind = _kind(name)
        if kind == "sum":
            out[name] = safe_divide(metric.numerator, metric.denominator)
        elif kind == "explained_var":
            out[name] = _finish_explained_variance(metric)
        elif kind == "expert_load":  # counts [layers, E]
            counts = metric.numerator
            peak = jnp.max(safe_divide(jnp.max(counts, axis=-1), jnp.mean(counts, axis=-1)))
            out[name] = jnp.where(metric.denominator == 0, 0, peak)
        else:
            out[name] = jnp.where(metric.denominator == 0, 0, metric.numerator)
    return out


def reduce(pieces: Iterable[Mapping[str, Metric]]) -> dict[str, Array]:
    """Whole-mini-batch values from the metrics of its pieces: :func:`combine_all` then :func:`finish`."""
    return finish(combine_all(pieces))


def mean_over_steps(steps: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Summarizes finished per-optimizer-step metrics: mean, or max/min for keys ending in ``_max``/``_min``."""
    names = sorted({name for step in steps for name in step})
    out = {}
    for name in names:
        values = [float(step[name]) for step in steps if name in step]
        kind = _kind(name)
        out[name] = max(values) if kind == "max" else min(values) if kind == "min" else sum(values) / len(values)
    return out
