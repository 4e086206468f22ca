"""KL estimators between the current and the reference policy, as a loss term and as a reward penalty.

Per token, with ``d = logp - logp_ref`` (Schulman's estimators of ``KL(pi || pi_ref)`` from samples of ``pi``):

=========================  ===========================================================================
kind                       value
=========================  ===========================================================================
``kl``, ``k1``             ``d``
``abs``                    ``|d|``
``mse``, ``k2``            ``d^2 / 2``
``low_var_kl``, ``k3``     ``clip(exp(-d') + d' - 1, -10, 10)`` with ``d' = clip(d, -20, 20)``
=========================  ===========================================================================

A ``+`` suffix (``k1+``, ``k3+``, ``low_var_kl+``, ``abs+``, ...) is straight-through: the value of the base kind
with the gradient of ``k2`` (whose expected gradient is the gradient of the KL, unlike k1's and k3's).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jppo.core import metrics as metrics_lib
from jppo.core.masked import NormStats, check_token_arrays, select_valid
from jppo.losses.aggregate import agg_loss, check_mode

Array = jax.Array

BASE_KL_KINDS: tuple[str, ...] = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
KL_KINDS: tuple[str, ...] = BASE_KL_KINDS + tuple(kind + "+" for kind in BASE_KL_KINDS)

# Bounds of the k3 estimator: the exponent and the estimate itself, for numerical safety.
_K3_LOG_RATIO_BOUND = 20.0
_K3_VALUE_BOUND = 10.0


def check_kl_kind(kind: str) -> str:
    """Returns ``kind`` if it is a known estimator; raises ``ValueError`` listing the valid ones."""
    if kind not in KL_KINDS:
        raise ValueError(f"unknown KL kind {kind!r}; valid kinds: {', '.join(KL_KINDS)}")
    return kind


def _base_kl(log_ratio: Array, kind: str) -> Array:
    if kind in ("kl", "k1"):
        return log_ratio
    if kind == "abs":
        # sign(d) * d rather than abs: its gradient at d = 0 is 0 (the minimum's subgradient, as in torch).
        return jnp.sign(log_ratio) * log_ratio
    if kind in ("mse", "k2"):
        return 0.5 * jnp.square(log_ratio)
    # low_var_kl / k3
    reverse = jnp.clip(-log_ratio, -_K3_LOG_RATIO_BOUND, _K3_LOG_RATIO_BOUND)
    return jnp.clip(jnp.exp(reverse) - reverse - 1, -_K3_VALUE_BOUND, _K3_VALUE_BOUND)


def kl_penalty(log_prob: Array, ref_log_prob: Array, kind: str) -> Array:
    """Per-token KL estimate of ``kind`` (see the module docstring), at every position.

    Elementwise: where the inputs are NaN the estimate is NaN; :func:`kl_loss` and :func:`penalize_rewards`
    zero padded inputs first.
    """
    check_kl_kind(kind)
    log_ratio = log_prob - ref_log_prob
    value = _base_kl(log_ratio, kind.removesuffix("+"))
    if not kind.endswith("+"):
        return value
    k2 = _base_kl(log_ratio, "k2")
    return k2 - jax.lax.stop_gradient(k2) + jax.lax.stop_gradient(value)


def kl_loss(
    log_prob: Array,
    ref_log_prob: Array,
    mask: Array,
    *,
    kind: str,
    mode: str,
    norm: NormStats,
) -> tuple[Array, dict[str, metrics_lib.Metric]]:
    """This call's share of ``agg(kl_penalty(logp, logp_ref, kind))``, and ``actor/kl_loss``.

    Inputs may hold anything (even NaN) where ``mask`` is 0. ``norm``: the whole mini-batch's normalizers (see
    :func:`~jppo.losses.aggregate.agg_loss`).
    """
    check_kl_kind(kind)
    check_mode(mode)
    log_prob, ref_log_prob = select_valid(mask, log_prob=log_prob, ref_log_prob=ref_log_prob)
    valid = mask.astype(bool)
    share = agg_loss(kl_penalty(log_prob, ref_log_prob, kind), valid, mode, norm)
    return share, {"actor/kl_loss": metrics_lib.loss_share(share, valid, norm)}


def penalize_rewards(
    token_level_scores: Array,
    old_log_prob: Array,
    ref_log_prob: Array,
    mask: Array,
    *,
    kl_coef: float | Array,
    kind: str = "kl",
) -> tuple[Array, Array]:
    """KL-in-reward: ``rewards = scores - kl_coef * kl`` on valid tokens, with ``kl = kl_penalty(old, ref, kind)``.

    The estimate uses the rollout-time log-probs (no gradient flows into rewards). Where ``mask`` is 0 the
    estimate is 0, so the scores there pass through unchanged (an empty row's outcome score stays visible to
    sequence-level advantage estimators). ``kl_coef`` may be a traced value, e.g. an adaptive controller's state.

    Returns:
        ``(rewards, kl)``, both ``[batch, length]``; ``kl`` is 0 where ``mask`` is 0 (feed its masked mean to the
        KL controller).
    """
    check_kl_kind(kind)
    old_log_prob, ref_log_prob = select_valid(mask, old_log_prob=old_log_prob, ref_log_prob=ref_log_prob)
    check_token_arrays(mask, token_level_scores=token_level_scores)
    kl = jnp.where(mask.astype(bool), kl_penalty(old_log_prob, ref_log_prob, kind), 0)
    return token_level_scores - kl_coef * kl, kl
