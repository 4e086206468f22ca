"""Masked numerics: the bottom layer under the loss terms, the advantage estimators and the metrics.

Every array here comes with a mask ``m`` (bool or 0/1) of the response positions that count. Values at positions
where ``m = 0`` are never read: they are replaced by 0 before any arithmetic, so NaN or Inf there reaches neither
a result nor its gradient (a ``where`` on the output alone would still produce ``0 * NaN`` in the backward pass).

With ``x`` the values and ``N = sum m``:

- ``masked_sum = sum m x``;
- ``masked_mean = sum m x / N`` (0 when ``N = 0``);
- ``masked_var = sum m (x - mean)^2 / (N - 1)`` (unbiased) or ``/ N`` (biased); 0 when the divisor is not positive;
- ``masked_whiten = (x - mean) / sqrt(var_unbiased + epsilon)`` on valid positions, 0 on masked ones.

Divisions are exact and give 0 where the divisor is 0, so everything stays jittable without data-dependent
errors. ``epsilon = 1e-8`` in the whitening keeps rounding noise from being blown up when all valid values are
(nearly) equal.

:class:`NormStats` holds the whole-mini-batch counts every loss term is normalized by (see
:mod:`jppo.losses.aggregate`); :func:`global_norm_stats` computes them.

This module imports nothing from jppo: the losses, the advantages and the metrics all build on it.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from flax import struct

Array = jax.Array


# ------------------------------------------------------------------------------------------------- shape checks


def check_token_arrays(mask: Array, **arrays: Array) -> None:
    """Raises ``ValueError`` unless ``mask`` is ``[batch, length]`` and every named array has its shape."""
    if mask.ndim != 2:
        raise ValueError(f"mask must be [batch, length]; got shape {tuple(mask.shape)}")
    for name, array in arrays.items():
        if array.shape != mask.shape:
            raise ValueError(f"{name} must have the mask's shape {tuple(mask.shape)}; got {tuple(array.shape)}")


def check_row_arrays(mask: Array, **arrays: Array) -> None:
    """Raises ``ValueError`` unless every named array is ``[batch]`` for the ``[batch, length]`` mask."""
    for name, array in arrays.items():
        if array.shape != mask.shape[:1]:
            raise ValueError(f"{name} must be [batch] = {tuple(mask.shape[:1])}; got {tuple(array.shape)}")


# -------------------------------------------------------------------------------------------- safe elementwise


def float_dtype(array: Array) -> jnp.dtype:
    """``array``'s dtype if it is floating, else the default float dtype (float64 under x64)."""
    return array.dtype if jnp.issubdtype(array.dtype, jnp.floating) else jnp.result_type(float)


def safe_divide(numerator: Array, denominator: Array) -> Array:
    """``numerator / denominator``, and exactly 0 (with a zero gradient) where the denominator is 0."""
    nonzero = denominator != 0
    return jnp.where(nonzero, numerator / jnp.where(nonzero, denominator, 1), 0)


def safe_sqrt(values: Array) -> Array:
    """``sqrt`` of non-negative ``values`` with a finite (zero) gradient at 0, where ``sqrt``'s is infinite."""
    positive = values > 0
    return jnp.where(positive, jnp.sqrt(jnp.where(positive, values, 1)), 0)


def sanitize(values: Array, valid: Array) -> Array:
    """``values`` where ``valid``, 0 elsewhere: NaN/Inf at masked positions reach neither results nor gradients."""
    return jnp.where(valid, values, 0)


def select_valid(mask: Array, **arrays: Array) -> tuple[Array, ...]:
    """Checks that every array has the mask's ``[batch, length]`` shape and zeroes it where the mask is 0.

    Inputs at padded positions may be NaN or Inf; zeroing them before any arithmetic keeps them out of both the
    result and its gradient. Returns the arrays in the order given.
    """
    check_token_arrays(mask, **arrays)
    valid = mask.astype(bool)
    return tuple(sanitize(array, valid) for array in arrays.values())


# ---------------------------------------------------------------------------------------- masked reductions


def masked_sum(values: Array, mask: Array, axis: int | tuple[int, ...] | None = None) -> Array:
    """Sum of ``values`` where ``mask`` is set; NaN or Inf under the mask never reach the result or its gradient."""
    return jnp.sum(jnp.where(mask.astype(bool), values, 0), axis=axis)


def masked_mean(x: Array, mask: Array, axis: int | tuple[int, ...] | None = None) -> Array:
    """Mean of ``x`` over positions where ``mask`` is set, reduced over ``axis`` (all axes by default).

    ``sum m x / sum m``; exactly 0 (with a zero gradient) where no position is valid.
    """
    count = jnp.sum(mask.astype(bool), axis=axis, dtype=float_dtype(x))
    return safe_divide(masked_sum(x, mask, axis=axis), count)


def masked_var(x: Array, mask: Array, unbiased: bool = True) -> Array:
    """Variance of the valid entries of ``x`` (all axes).

    ``sum m (x - mean)^2 / (N - 1)`` with Bessel's correction (``unbiased=True``), else ``/ N``. Returns 0 when
    there are too few valid entries for the divisor to be positive.
    """
    valid = mask.astype(bool)
    dtype = float_dtype(x)
    count = jnp.sum(valid, dtype=dtype)
    squared_deviation = jnp.square(sanitize(x - masked_mean(x, valid), valid))
    divisor = jnp.maximum(count - 1, 0) if unbiased else count
    return safe_divide(jnp.sum(squared_deviation), divisor)


def masked_whiten(x: Array, mask: Array, shift_mean: bool = True, epsilon: float = 1e-8) -> Array:
    """Standardizes ``x`` with the mean and unbiased variance of its valid entries.

    ``(x - mean) / sqrt(var + epsilon)`` at valid positions (``mean`` added back when ``shift_mean`` is False),
    exactly 0 at masked ones.
    """
    valid = mask.astype(bool)
    mean = masked_mean(x, valid)
    whitened = sanitize(x - mean, valid) * jax.lax.rsqrt(masked_var(x, valid) + epsilon)
    if not shift_mean:
        whitened = whitened + mean
    return sanitize(whitened, valid)


# -------------------------------------------------------------------------------- whole-mini-batch normalizers


@struct.dataclass
class NormStats:
    """Whole-mini-batch normalizers carried into every micro-batch's loss.

    Attributes:
        num_tokens: ``N``, valid (mask = 1) tokens in the whole mini-batch, all shards.
        num_seqs: ``S``, rows of the whole mini-batch with at least one valid token.
        loss_scale_factor: ``C``, a configured constant (e.g. the maximum response length), used by
            ``seq-mean-token-sum-norm`` only. Never the padded width of a micro-batch.
        expert_fractions: for a model with experts and a load-balancing loss, ``f_e [E]``: the fraction of the
            whole mini-batch's (token, layer) pairs routed to expert ``e`` (``k`` per pair in all), else ``None``.
        routed_pairs: ``R``, the (non-padding token, layer with experts) pairs of the whole mini-batch, with
            ``expert_fractions``.
    """

    num_tokens: Array
    num_seqs: Array
    loss_scale_factor: Array
    expert_fractions: Array | None = None
    routed_pairs: Array | None = None


def global_norm_stats(
    mask: Array,
    loss_scale_factor: float | Array = 1.0,
    axis_name: str | Sequence[str] | None = None,
    dtype: jnp.dtype | None = None,
    token_axis: str | None = None,
) -> NormStats:
    """Counts ``N`` and ``S`` of ``mask`` and sums them over the batch mesh axes.

    Call it on the whole mini-batch, before cutting it into micro-batches. Inside ``jax.shard_map`` pass the
    batch axes as ``axis_name`` (a name or a tuple of names): the shard-local counts are ``psum``-ed, so every
    shard holds the global values. Under plain ``jax.jit`` with sharded global arrays leave ``axis_name=None``:
    the sums over the global array are already global. (Called on one micro-batch, it gives that micro-batch's
    own counts: what the legacy per-micro-batch normalization passes.)

    Args:
        mask: ``[batch, length]`` response mask (bool or 0/1).
        loss_scale_factor: ``C`` for ``seq-mean-token-sum-norm``.
        axis_name: mesh axes to sum over, or ``None``.
        dtype: float dtype of the statistics; defaults to float32 (float64 when x64 is on and the mask is float64).
        token_axis: the one of ``axis_name`` that splits each row's tokens (context parallelism), or ``None``: a
            row's token count is summed over it before the row is counted, so a row whose valid tokens all sit
            on one shard counts once, and a row split over shards is one sequence, not one per shard.
    """
    check_token_arrays(mask)
    if dtype is None:
        dtype = mask.dtype if jnp.issubdtype(mask.dtype, jnp.floating) else jnp.float32
    valid = mask.astype(bool)
    num_tokens = jnp.sum(valid, dtype=dtype)
    if token_axis is None:
        num_seqs = jnp.sum(jnp.any(valid, axis=-1), dtype=dtype)
        if axis_name is not None:
            num_tokens, num_seqs = jax.lax.psum((num_tokens, num_seqs), axis_name)
    else:  # n_i over every shard of the row first: S counts the rows with n_i > 0, once each
        names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
        row_tokens = jax.lax.psum(jnp.sum(valid, axis=-1, dtype=dtype), token_axis)
        num_tokens = jax.lax.psum(num_tokens, names)
        num_seqs = jax.lax.psum(jnp.sum(row_tokens > 0, dtype=dtype), tuple(n for n in names if n != token_axis))
    return NormStats(
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        loss_scale_factor=jnp.asarray(loss_scale_factor, dtype=dtype),
    )
