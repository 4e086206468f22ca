"""Global normalizers and loss aggregation: the one place where a per-token loss becomes a scalar.

A mini-batch is cut into micro-batches (and over data-parallel shards). Each call of :func:`agg_loss` returns the
*share* of one piece; the shares of all pieces sum exactly to the whole-mini-batch loss, so their gradients sum to
the whole-mini-batch gradient whatever the cut. This holds because every denominator comes from
:class:`NormStats`, computed once over the whole mini-batch, never from the piece being aggregated.

With ``m`` the mask, ``l`` the loss matrix, ``n_i = sum_t m_it`` the valid tokens of row ``i``, and
``N = sum_i n_i``, ``S = #{i : n_i > 0}``, ``C`` the constant ``loss_scale_factor`` of the mini-batch:

============================  ====================================================
mode                          share of the rows ``i`` seen by this call
============================  ====================================================
``token-mean``                ``sum_{i,t} m l / N``
``token-sum``                 ``sum_{i,t} m l``
``seq-mean-token-sum``        ``sum_i (sum_t m l) / S``
``seq-mean-token-mean``       ``sum_{i: n_i > 0} (sum_t m l / n_i) / S``
``seq-mean-token-sum-norm``   ``sum_i (sum_t m l) / (S C)``
============================  ====================================================

There is no data-parallel size factor: in JAX the gradients of the shards are summed, not averaged.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from flax import struct

Array = jax.Array

AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


@struct.dataclass
class NormStats:
    """Whole-mini-batch normalizers carried into every micro-batch's loss.

    Attributes:
        num_tokens: ``N``, valid (mask = 1) tokens in the whole mini-batch, all shards.
        num_seqs: ``S``, rows of the whole mini-batch with at least one valid token.
        loss_scale_factor: ``C``, a configured constant (e.g. the maximum response length), used by
            ``seq-mean-token-sum-norm`` only. Never the padded width of a micro-batch.
    """

    num_tokens: Array
    num_seqs: Array
    loss_scale_factor: Array


def check_mode(mode: str) -> str:
    """Returns ``mode`` if it is a known aggregation mode; raises ``ValueError`` naming the valid ones."""
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; valid modes: {', '.join(AGG_MODES)}")
    return mode


def _check_shapes(loss_mat: Array, mask: Array) -> None:
    if loss_mat.shape != mask.shape or loss_mat.ndim != 2:
        raise ValueError(
            f"loss matrix and mask must both be [batch, length]; got {tuple(loss_mat.shape)} and {tuple(mask.shape)}"
        )


def global_norm_stats(
    mask: Array,
    loss_scale_factor: float | Array = 1.0,
    axis_name: str | Sequence[str] | None = None,
    dtype: jnp.dtype | None = None,
) -> NormStats:
    """Counts ``N`` and ``S`` of ``mask`` and sums them over the batch mesh axes.

    Call it on the whole mini-batch, before cutting it into micro-batches. Inside ``jax.shard_map`` pass the
    batch axes as ``axis_name`` (a name or a tuple of names): the shard-local counts are ``psum``-ed, so every
    shard holds the global values. Under plain ``jax.jit`` with sharded global arrays leave ``axis_name=None``:
    the sums over the global array are already global.

    Args:
        mask: ``[batch, length]`` response mask (bool or 0/1).
        loss_scale_factor: ``C`` for ``seq-mean-token-sum-norm``.
        axis_name: mesh axes to sum over, or ``None``.
        dtype: float dtype of the statistics; defaults to float32 (float64 when x64 is on and the mask is float64).
    """
    if mask.ndim != 2:
        raise ValueError(f"mask must be [batch, length]; got shape {tuple(mask.shape)}")
    if dtype is None:
        dtype = mask.dtype if jnp.issubdtype(mask.dtype, jnp.floating) else jnp.float32
    valid = mask.astype(bool)
    num_tokens = jnp.sum(valid, dtype=dtype)
    num_seqs = jnp.sum(jnp.any(valid, axis=-1), dtype=dtype)
    if axis_name is not None:
        num_tokens, num_seqs = jax.lax.psum((num_tokens, num_seqs), axis_name)
    return NormStats(
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        loss_scale_factor=jnp.asarray(loss_scale_factor, dtype=dtype),
    )


def safe_divide(numerator: Array, denominator: Array) -> Array:
    """``numerator / denominator``, and exactly 0 (with a zero gradient) where the denominator is 0."""
    nonzero = denominator != 0
    return jnp.where(nonzero, numerator / jnp.where(nonzero, denominator, 1), 0)


def masked_sum(values: Array, mask: Array, axis: int | tuple[int, ...] | None = None) -> Array:
    """Sum of ``values`` where ``mask`` is set; NaN or Inf under the mask never reach the result or its gradient."""
    return jnp.sum(jnp.where(mask.astype(bool), values, 0), axis=axis)


def select_valid(mask: Array, **arrays: Array) -> tuple[Array, ...]:
    """Checks that every array has the mask's ``[batch, length]`` shape and zeroes it where the mask is 0.

    Inputs at padded positions may be NaN or Inf; zeroing them before any arithmetic keeps them out of both the
    loss and its gradient (a ``where`` on the output alone would still produce ``0 * NaN`` in the backward pass).
    Returns the arrays in the order given.
    """
    if mask.ndim != 2:
        raise ValueError(f"mask must be [batch, length]; got shape {tuple(mask.shape)}")
    for name, array in arrays.items():
        if array.shape != mask.shape:
            raise ValueError(f"{name} must have the mask's shape {tuple(mask.shape)}; got {tuple(array.shape)}")
    valid = mask.astype(bool)
    return tuple(jnp.where(valid, array, 0) for array in arrays.values())


def agg_loss(loss_mat: Array, mask: Array, mode: str, norm: NormStats | None = None) -> Array:
    """This call's share of the whole-mini-batch loss (see the module docstring for the formulas).

    Args:
        loss_mat: ``[batch, length]`` per-token loss. Values under ``mask == 0`` are ignored, even NaN/Inf.
        mask: ``[batch, length]`` response mask.
        mode: one of :data:`AGG_MODES`.
        norm: whole-mini-batch normalizers. ``None`` uses this call's own mask (correct only when the call sees
            the whole mini-batch); not allowed for ``seq-mean-token-sum-norm``, whose C comes only from ``norm``.

    Returns:
        A scalar of ``loss_mat``'s dtype. Rows without valid tokens contribute exactly 0.
    """
    check_mode(mode)
    _check_shapes(loss_mat, mask)
    if norm is None:
        if mode == "seq-mean-token-sum-norm":
            # C is a configured constant; no mask can supply it (a padded width would make it split-dependent)
            raise ValueError("loss_agg_mode 'seq-mean-token-sum-norm' needs norm=NormStats(..., loss_scale_factor=C)")
        norm = global_norm_stats(mask, dtype=loss_mat.dtype)
    dtype = loss_mat.dtype
    num_tokens = norm.num_tokens.astype(dtype)
    num_seqs = norm.num_seqs.astype(dtype)
    if mode == "token-mean":
        return safe_divide(masked_sum(loss_mat, mask), num_tokens)
    if mode == "token-sum":
        return masked_sum(loss_mat, mask)
    row_sums = masked_sum(loss_mat, mask, axis=-1)
    if mode == "seq-mean-token-sum":
        return safe_divide(jnp.sum(row_sums), num_seqs)
    if mode == "seq-mean-token-mean":
        row_tokens = jnp.sum(mask.astype(bool), axis=-1).astype(dtype)
        return safe_divide(jnp.sum(safe_divide(row_sums, row_tokens)), num_seqs)
    # seq-mean-token-sum-norm (Dr. GRPO): a constant in place of the per-row token count.
    return safe_divide(jnp.sum(row_sums), num_seqs * norm.loss_scale_factor.astype(dtype))
