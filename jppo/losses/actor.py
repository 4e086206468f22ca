"""The actor's loss for one micro-batch.

``actor = pg - entropy_coeff * entropy + kl_loss_coef * kl``: every term is aggregated with the SAME mode and
:class:`~jppo.core.masked.NormStats`, so the sum of the micro-batch shares is the whole-mini-batch objective whatever
the cut. The critic's loss is :func:`~jppo.losses.value.value_loss`.
"""

from __future__ import annotations

import dataclasses

import jax

from jppo.core import metrics as metrics_lib
from jppo.core.masked import NormStats
from jppo.core.settings import PolicyLossOptions, RolloutCorrection
from jppo.losses.aggregate import check_mode
from jppo.losses.entropy import entropy_loss
from jppo.losses.kl import check_kl_kind, kl_loss
from jppo.losses.policy import check_policy_loss_mode, policy_loss
from jppo.losses.rollout_correction import rollout_weights

Array = jax.Array


def _is_zero(coefficient: float | Array) -> bool:
    return isinstance(coefficient, (int, float)) and coefficient == 0


def actor_loss(
    log_prob: Array,
    old_log_prob: Array,
    advantages: Array,
    mask: Array,
    *,
    norm: NormStats,
    mode: str,
    policy_loss_name: str,
    policy_options: PolicyLossOptions,
    entropy: Array | None = None,
    entropy_coeff: float | Array = 0.0,
    ref_log_prob: Array | None = None,
    kl_loss_coef: float | Array = 0.0,
    kl_loss_type: str = "low_var_kl",
    rollout_log_prob: Array | None = None,
    rollout_correction: RolloutCorrection = RolloutCorrection(),
) -> tuple[Array, dict[str, metrics_lib.Metric]]:
    """This micro-batch's share of ``pg - entropy_coeff * entropy + kl_loss_coef * kl``, and the merged metrics.

    The entropy term (metric ``actor/entropy``) is computed when ``entropy`` is given and the KL term (metric
    ``actor/kl_loss``) when ``ref_log_prob`` is given; with ``rollout_log_prob`` the policy-gradient term is weighted
    by ``rollout_correction`` and the ``rollout_corr/*`` metrics are reported
    (:mod:`jppo.losses.rollout_correction`); which terms exist is decided in Python, at trace time.
    A coefficient that is not the number 0 without its input is an error. Names (mode, variant, KL kind) and the
    variant's required mode (the sequence-level ``gspo`` and ``geo_mean`` need ``seq-mean-token-mean``) are
    checked before anything is computed.

    Args:
        log_prob, old_log_prob, advantages, mask: as for :func:`~jppo.losses.policy.policy_loss`.
        norm: whole-mini-batch normalizers (the micro-batch's own counts only in the legacy per-micro-batch mode).
        mode: aggregation mode shared by all terms.
        policy_loss_name: a registered policy-loss variant.
        policy_options: its options.
        entropy: ``[batch, length]`` token entropy of the current policy.
        entropy_coeff: weight of the entropy bonus.
        ref_log_prob: ``[batch, length]`` reference-policy log-probs.
        kl_loss_coef: weight of the KL loss.
        kl_loss_type: KL estimator (see :mod:`jppo.losses.kl`).
        rollout_log_prob: ``[batch, length]`` the sampler's log-probs of its tokens.
        rollout_correction: the correction of the sampler/trainer mismatch; any mode but ``none`` needs
            ``rollout_log_prob``.
    """
    check_mode(mode)
    check_policy_loss_mode(policy_loss_name, mode)
    if ref_log_prob is not None:
        check_kl_kind(kl_loss_type)
    if entropy is None and not _is_zero(entropy_coeff):
        raise ValueError(f"entropy_coeff={entropy_coeff!r} needs the token entropy, but entropy is None")
    if ref_log_prob is None and not _is_zero(kl_loss_coef):
        raise ValueError(f"kl_loss_coef={kl_loss_coef!r} needs ref_log_prob, but it is None")
    rollout_correction.check()
    if rollout_log_prob is None and rollout_correction.mode != "none":
        raise ValueError(f"rollout_correction.mode={rollout_correction.mode!r} needs rollout_log_prob, but it is None")
    weights, correction_metrics = None, {}
    if rollout_log_prob is not None:
        weights, correction_metrics = rollout_weights(old_log_prob, rollout_log_prob, mask, rollout_correction)
    share, metrics = policy_loss(
        policy_loss_name,
        log_prob,
        old_log_prob,
        advantages,
        mask,
        mode=mode,
        norm=norm,
        weights=weights,
        **dataclasses.asdict(policy_options),
    )
    metrics.update(correction_metrics)
    if entropy is not None:
        entropy_share, entropy_metrics = entropy_loss(entropy, mask, mode=mode, norm=norm)
        share = share - entropy_coeff * entropy_share
        metrics.update(entropy_metrics)
    if ref_log_prob is not None:
        kl_share, kl_metrics = kl_loss(log_prob, ref_log_prob, mask, kind=kl_loss_type, mode=mode, norm=norm)
        share = share + kl_loss_coef * kl_share
        metrics.update(kl_metrics)
    return share, metrics
