"""Loss aggregation: the one place where a per-token loss becomes a scalar.

A mini-batch is cut into micro-batches (and over data-parallel shards). Each call of :func:`agg_loss` returns the
*share* of one piece; the shares of all pieces sum exactly to the whole-mini-batch loss, so their gradients sum to
the whole-mini-batch gradient whatever the cut. This holds because every denominator comes from
:class:`~jppo.core.masked.NormStats`, computed once over the whole mini-batch, never from the piece being aggregated.

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

import jax
import jax.numpy as jnp

from jppo.core.masked import NormStats, check_token_arrays, masked_sum, safe_divide

Array = jax.Array

AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def check_mode(mode: str) -> str:
    """Returns ``mode`` if it is a known aggregation mode; raises ``ValueError`` naming the valid ones."""
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; valid modes: {', '.join(AGG_MODES)}")
    return mode


def agg_loss(loss_mat: Array, mask: Array, mode: str, norm: NormStats) -> Array:
    """This call's share of the whole-mini-batch loss (see the module docstring for the formulas).

    Args:
        loss_mat: ``[batch, length]`` per-token loss. Values under ``mask == 0`` are ignored, even NaN/Inf.
        mask: ``[batch, length]`` response mask.
        mode: one of :data:`AGG_MODES`.
        norm: whole-mini-batch normalizers (:func:`~jppo.core.masked.global_norm_stats` of the whole mini-batch, before
            it is cut). Only a call that sees the whole mini-batch, or the legacy per-micro-batch mode, passes the
            counts of its own mask; ``C`` of ``seq-mean-token-sum-norm`` is always the configured constant.

    Returns:
        A scalar of ``loss_mat``'s dtype. Rows without valid tokens contribute exactly 0.
    """
    check_mode(mode)
    check_token_arrays(mask, loss_mat=loss_mat)
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
