"""The critic's clipped value loss.

Per token, with ``v`` the current prediction, ``v_old`` the value at rollout time, ``R`` the return and ``eps`` the
value clip range::

    e = max((v - R)^2, (clip(v, v_old - eps, v_old + eps) - R)^2)

The loss is ``0.5 * agg(e)`` through :func:`~jppo.losses.aggregate.agg_loss` with the caller's mode and
:class:`~jppo.core.masked.NormStats`: the same normalization as every actor term, so the critic gradient does not
depend on the micro-batch count.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jppo.core import metrics as metrics_lib
from jppo.core.masked import NormStats, select_valid
from jppo.losses.aggregate import agg_loss, check_mode

Array = jax.Array


def clipped_value_error(vpreds: Array, values: Array, returns: Array, cliprange_value: float) -> tuple[Array, Array]:
    """Per-token ``e`` (see the module docstring) and where the clipped branch is strictly larger.

    Pure elementwise math: inputs must be finite (:func:`value_loss` zeroes padded positions before calling it).
    """
    clipped_vpreds = jnp.clip(vpreds, values - cliprange_value, values + cliprange_value)
    unclipped_error = jnp.square(vpreds - returns)
    clipped_error = jnp.square(clipped_vpreds - returns)
    return jnp.maximum(unclipped_error, clipped_error), clipped_error > unclipped_error


def value_loss(
    vpreds: Array,
    values: Array,
    returns: Array,
    mask: Array,
    *,
    cliprange_value: float,
    mode: str,
    norm: NormStats,
) -> tuple[Array, dict[str, metrics_lib.Metric]]:
    """This call's share of ``0.5 * agg(e)``, and the critic metrics.

    Args:
        vpreds: ``[batch, length]`` current value predictions (differentiate with respect to these).
        values: ``[batch, length]`` values at rollout time (the clip centre).
        returns: ``[batch, length]`` value targets.
        mask: ``[batch, length]`` response mask; the inputs may hold anything, even NaN, where it is 0.
        cliprange_value: ``eps``.
        mode: aggregation mode.
        norm: whole-mini-batch normalizers (see :func:`~jppo.losses.aggregate.agg_loss`).

    Returns:
        ``(share, metrics)`` with ``critic/vf_loss`` (the 0.5-scaled loss), ``critic/vf_clipfrac`` (token fraction
        where the clipped branch is strictly larger), ``critic/vpred_mean`` and ``critic/vf_explained_var``
        (``1 - Var(returns - vpreds) / Var(returns)``).
    """
    check_mode(mode)
    vpreds, values, returns = select_valid(mask, vpreds=vpreds, values=values, returns=returns)
    valid = mask.astype(bool)
    error, clipped = clipped_value_error(vpreds, values, returns, cliprange_value)
    share = 0.5 * agg_loss(error, valid, mode, norm)
    return share, {
        "critic/vf_loss": metrics_lib.loss_share(share, valid, norm),
        "critic/vf_clipfrac": metrics_lib.ratio(clipped.astype(error.dtype), valid),
        "critic/vpred_mean": metrics_lib.ratio(vpreds, valid),
        "critic/vf_explained_var": metrics_lib.explained_variance(returns, vpreds, valid),
    }
