"""Pure, jittable loss terms. Every term builds a per-token matrix that goes through :func:`agg_loss`, normalized
by the whole mini-batch's :class:`~jppo.core.masked.NormStats` (a required argument of every term)."""

from jppo.core.settings import REJECTION_MODES, ROLLOUT_CORRECTION_MODES, PolicyLossOptions, RolloutCorrection
from jppo.losses.actor import actor_loss
from jppo.losses.aggregate import AGG_MODES, agg_loss, check_mode
from jppo.losses.entropy import entropy_from_logits, entropy_loss
from jppo.losses.kl import KL_KINDS, check_kl_kind, kl_loss, kl_penalty, penalize_rewards
from jppo.losses.policy import (
    OPTION_RULES,
    POLICY_LOSSES,
    REQUIRED_AGG_MODES,
    OptionRule,
    PerToken,
    PolicyLossFn,
    check_policy_loss_mode,
    check_policy_options,
    get_policy_loss,
    policy_loss,
    register_policy_loss,
    required_agg_mode,
)
from jppo.losses.rollout_correction import rejected_rows, rollout_weights
from jppo.losses.sft import sft_loss
from jppo.losses.value import clipped_value_error, value_loss

__all__ = [
    "AGG_MODES",
    "KL_KINDS",
    "OPTION_RULES",
    "POLICY_LOSSES",
    "REJECTION_MODES",
    "REQUIRED_AGG_MODES",
    "ROLLOUT_CORRECTION_MODES",
    "OptionRule",
    "PerToken",
    "PolicyLossFn",
    "PolicyLossOptions",
    "RolloutCorrection",
    "actor_loss",
    "agg_loss",
    "check_kl_kind",
    "check_mode",
    "check_policy_loss_mode",
    "check_policy_options",
    "clipped_value_error",
    "entropy_from_logits",
    "entropy_loss",
    "get_policy_loss",
    "kl_loss",
    "kl_penalty",
    "penalize_rewards",
    "policy_loss",
    "register_policy_loss",
    "rejected_rows",
    "required_agg_mode",
    "rollout_weights",
    "sft_loss",
    "value_loss",
]
