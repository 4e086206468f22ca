"""Policy-gradient loss terms: a registry of per-token losses and the one dispatcher that aggregates them.

Notation, per token ``(i, t)`` of the response: ``logp`` the current log-prob, ``logp_old`` the log-prob at
rollout time, ``A`` the advantage, ``d = logp - logp_old`` the log-ratio, ``r = exp(clip(d, -20, 20))`` the
importance ratio (the clamp only guards ``exp``), ``eps_lo / eps_hi`` the clip ratios (``clip_ratio_low`` /
``clip_ratio_high``, each defaulting to ``clip_ratio``), ``sg`` stop-gradient, ``n_i`` the valid tokens of row i.

Every registered variant is a pure function ``(log_prob, old_log_prob, advantages, mask, options) -> PerToken``:
a per-token loss matrix plus per-token indicators for the metrics. Only :func:`policy_loss` aggregates, and only
through :func:`~jppo.losses.aggregate.agg_loss` with the caller's mode and :class:`NormStats`, so every variant
obeys the normalization contract (a gradient does not depend on how its batch was cut).

Variants (``l`` is the per-token loss):

- ``vanilla`` (PPO, asymmetric clip, dual clip): ``l = max(-A r, -A clip(r, 1-eps_lo, 1+eps_hi))``, and for
  ``A < 0`` additionally ``l = min(l, -A c)`` with ``c = clip_ratio_c > 1``.
- ``gspo``: sequence ratio ``s_i = exp(mean_t d)`` applied per token as
  ``s_it = exp(min(logp - sg(logp) + sg(log s_i), 10))`` (value ``s_i``, gradient of ``logp`` scaled by ``s_i``),
  then ``l = max(-A s_it, -A clip(s_it, 1-eps_lo, 1+eps_hi))``.
- ``geo_mean`` (GMPO): ``rho_it = sign(A) min(sign(A) d, sign(A) clip(d, -eps_lo, eps_hi))``; the sequence
  objective ``L_i = -mean_t(A) exp(mean_t rho_it)`` is written on EVERY valid token of row i (``l_it = L_i``).
  Aggregated with ``seq-mean-token-mean`` this is ``mean_i L_i`` over the non-empty rows (fully masked rows are
  not sequences and do not count in the denominator). Other modes weight the same ``L_i`` by tokens
  (``token-mean``: by ``n_i``).
- ``cispo``: ``l = -sg(clip(r, 1-eps_lo, 1+eps_hi)) A logp``.
- ``gpg``: ``l = -A logp``.
- ``sapo``: ``l = -A (4 / tau) sigmoid(tau (r - 1))`` with ``tau = tau_pos`` where ``A > 0``, else ``tau_neg``.
- ``dro``: ``l = -(A logp - beta d^2 / 2)`` with ``beta = dro_beta > 0``.
- ``dppo_tv`` / ``dppo_kl`` (DPPO-Binary): ``l = -A sg(min(r, c)) logp`` on trusted tokens, 0 elsewhere. With
  ``p = exp(logp)``: TV trusts ``p - p_old <= eps_hi`` where ``A > 0`` and ``p - p_old >= -eps_lo`` otherwise;
  KL trusts ``KL_bin(p_old || p) <= eps_hi or p <= p_old`` where ``A > 0`` and ``<= eps_lo or p >= p_old``
  otherwise. ``c`` is ``clip_ratio_c`` (the dual-clip bound's option, default 3), so set it for DPPO.

Sequence-level variants (``gspo``, ``geo_mean``) take each row of the ``[batch, length]`` inputs as ONE sequence:
call them on padded rows, never on rows that pack several sequences. Rows are never split across micro-batches, so
their per-row statistics are the same whatever the cut. Their objectives are means over sequences, i.e. defined
under ``seq-mean-token-mean``: each registers that mode (:data:`REQUIRED_AGG_MODES`), and the actor objective and
the config refuse any other. :func:`policy_loss` itself still aggregates them under any mode, as a term whose
split invariance holds for every mode.

Metrics (token-weighted over the whole mini-batch, whatever the cut): ``actor/pg_clipfrac`` (fraction of tokens
where the clipped branch is active / untrusted for DPPO), ``actor/pg_clipfrac_lower`` (dual-clip active for
vanilla; ``A < 0`` and clipped for GMPO; ``r > c`` on trusted tokens for DPPO; 0 elsewhere), ``actor/ppo_kl``
(mean of ``-d``, with ``d`` clamped where the variant clamps it). Every variant reports all four, so metric dicts
always combine.

How these variants and metrics differ from verl's: ``tests/golden_verl/PARITY.md``.

Deliberately absent: ``clip_cov`` and ``kl_cov``. They pick the tokens to clip or penalize by a covariance
between log-probs and advantages, and by a top-k fraction, computed over the tokens the call sees, i.e. over the
micro-batch: the selection (and so the gradient) changes with the cut, which this module cannot allow.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from jppo.core import metrics as metrics_lib
from jppo.core.errors import InvalidSetting
from jppo.core.masked import NormStats, masked_mean, select_valid
from jppo.core.registry import Registry
from jppo.core.settings import PolicyLossOptions
from jppo.losses.aggregate import agg_loss, check_mode

Array = jax.Array

# exp(20) ~ 5e8: the log-ratio clamp that keeps exp finite.
_LOG_RATIO_BOUND = 20.0
# GSPO clamps its per-token log-ratio from above only.
_GSPO_LOG_RATIO_MAX = 10.0
# DPPO-KL's binary KL divides 1 - p_old by 1 - p; this keeps p = 1 finite (part of the definition).
_BINARY_KL_EPS = 1e-8


class PerToken(NamedTuple):
    """What a variant returns: ``[batch, length]`` matrices, meaningful where the mask is set.

    Attributes:
        loss: per-token loss, to be aggregated by :func:`agg_loss`.
        clipped: indicator behind ``actor/pg_clipfrac``.
        clipped_lower: indicator behind ``actor/pg_clipfrac_lower``.
        approx_kl: per-token ``logp_old - logp`` behind ``actor/ppo_kl``.
    """

    loss: Array
    clipped: Array
    clipped_lower: Array
    approx_kl: Array


class OptionRule(NamedTuple):
    """What a variant requires of one of its options: ``holds(value)``, stated for people as ``valid``."""

    option: str
    holds: Callable[[Any], bool]
    valid: str


PolicyLossFn = Callable[[Array, Array, Array, Array, PolicyLossOptions], PerToken]
POLICY_LOSSES: Registry[PolicyLossFn] = Registry(
    "policy loss", lambda name, names: f"unknown policy loss {name!r}; registered: {', '.join(sorted(names))}"
)
# The aggregation mode a variant's objective is defined under; a variant absent here fits every mode.
REQUIRED_AGG_MODES: dict[str, str] = {}
# What each variant requires of its options (checked by check_policy_options before anything is traced).
OPTION_RULES: dict[str, tuple[OptionRule, ...]] = {}

# Clip ratios are distances from 1 (or divergence thresholds): a negative one turns the trust region inside out.
CLIP_RULES = tuple(
    OptionRule(name, lambda value: value is None or value >= 0, ">= 0")
    for name in ("clip_ratio", "clip_ratio_low", "clip_ratio_high")
)
# DPPO truncates the stop-gradient ratio at clip_ratio_c: at or below 0 it would flip the update's sign.
_DPPO_RULES = CLIP_RULES + (OptionRule("clip_ratio_c", lambda value: value > 0, "> 0 (the ratio truncation)"),)


def register_policy_loss(
    name: str, *, agg_mode: str | None = None, requires: tuple[OptionRule, ...] = ()
) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a per-token policy loss in :data:`POLICY_LOSSES` under ``name``; ``agg_mode`` records
    the one aggregation mode its objective is defined under (``None``: any mode), ``requires`` what it needs of its
    options (:data:`OPTION_RULES`)."""
    if agg_mode is not None:
        check_mode(agg_mode)
    valid_options = {field.name for field in dataclasses.fields(PolicyLossOptions)}
    unknown = sorted({rule.option for rule in requires} - valid_options)
    if unknown:
        raise ValueError(f"policy loss {name!r} requires unknown option(s) {', '.join(unknown)}")

    def register(loss_fn: PolicyLossFn) -> PolicyLossFn:
        POLICY_LOSSES.register(name)(loss_fn)  # refuses a name registered twice
        OPTION_RULES[name] = tuple(requires)
        if agg_mode is not None:
            REQUIRED_AGG_MODES[name] = agg_mode
        return loss_fn

    return register


def check_policy_options(name: str, options: PolicyLossOptions) -> None:
    """:class:`~jppo.core.errors.InvalidSetting` naming the first option of ``options`` that variant ``name`` cannot
    use; the trainer's config runs the same check, so a bad value is refused before anything compiles."""
    get_policy_loss(name)
    for rule in OPTION_RULES[name]:
        value = getattr(options, rule.option)
        if not rule.holds(value):
            raise InvalidSetting(f"policy loss {name!r} option ", rule.option, value, rule.valid)


def get_policy_loss(name: str) -> PolicyLossFn:
    """The registered variant ``name``; ``ValueError`` listing the registered names otherwise."""
    return POLICY_LOSSES.lookup(name)


def required_agg_mode(name: str) -> str | None:
    """The aggregation mode the registered variant ``name`` needs, or ``None`` if it fits every mode."""
    get_policy_loss(name)
    return REQUIRED_AGG_MODES.get(name)


def check_policy_loss_mode(name: str, mode: str) -> None:
    """``ValueError`` in one line when variant ``name`` is defined under another aggregation mode than ``mode``."""
    required = required_agg_mode(name)
    if required is not None and mode != required:
        raise ValueError(
            f"policy loss {name!r} needs mode={required!r} (its objective is defined under it), got mode={mode!r}"
        )


def _row_mean(values: Array, mask: Array) -> Array:
    """``[batch, 1]`` mean of ``values`` over each row's valid tokens (0 for an empty row)."""
    return masked_mean(values, mask, axis=-1)[:, None]


def _clamped_log_ratio(log_prob: Array, old_log_prob: Array) -> Array:
    return jnp.clip(log_prob - old_log_prob, -_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)


@register_policy_loss(
    "vanilla", requires=CLIP_RULES + (OptionRule("clip_ratio_c", lambda value: value > 1, "> 1 (the dual-clip bound)"),)
)
def vanilla(
    log_prob: Array, old_log_prob: Array, advantages: Array, mask: Array, options: PolicyLossOptions
) -> PerToken:
    """PPO clipped surrogate with asymmetric clip ratios and dual clip for negative advantages."""
    log_ratio = _clamped_log_ratio(log_prob, old_log_prob)
    ratio = jnp.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1 - options.low, 1 + options.high)
    pessimistic = jnp.maximum(unclipped, clipped)
    dual_bound = -advantages * options.clip_ratio_c
    negative = advantages < 0
    loss = jnp.where(negative, jnp.minimum(pessimistic, dual_bound), pessimistic)
    return PerToken(loss, clipped > unclipped, negative & (pessimistic > dual_bound), -log_ratio)


@register_policy_loss("gspo", agg_mode="seq-mean-token-mean", requires=CLIP_RULES)
def gspo(log_prob: Array, old_log_prob: Array, advantages: Array, mask: Array, options: PolicyLossOptions) -> PerToken:
    """GSPO: the clipped surrogate on the sequence-level ratio, carried per token (see the module docstring)."""
    log_ratio = log_prob - old_log_prob
    sequence_log_ratio = jax.lax.stop_gradient(_row_mean(log_ratio, mask))
    token_log_ratio = log_prob - jax.lax.stop_gradient(log_prob) + sequence_log_ratio
    ratio = jnp.exp(jnp.minimum(token_log_ratio, _GSPO_LOG_RATIO_MAX))
    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1 - options.low, 1 + options.high)
    loss = jnp.maximum(unclipped, clipped)
    return PerToken(loss, clipped > unclipped, jnp.zeros_like(mask, dtype=bool), -log_ratio)


@register_policy_loss("geo_mean", agg_mode="seq-mean-token-mean", requires=CLIP_RULES)
def geo_mean(
    log_prob: Array, old_log_prob: Array, advantages: Array, mask: Array, options: PolicyLossOptions
) -> PerToken:
    """GMPO: a sequence objective on the geometric mean of token ratios, written on each valid token of the row."""
    log_ratio = log_prob - old_log_prob
    sign = jnp.sign(advantages)
    bounded = jnp.clip(log_ratio, -options.low, options.high)
    # Per token, the log-ratio that is worse for the objective in the advantage's direction (PPO's pessimism).
    pessimistic = sign * jnp.minimum(sign * log_ratio, sign * bounded)
    sequence_loss = -_row_mean(advantages, mask) * jnp.exp(_row_mean(pessimistic, mask))
    loss = jnp.broadcast_to(sequence_loss, log_prob.shape)
    clipped = log_ratio != bounded
    return PerToken(loss, clipped & (advantages > 0), clipped & (advantages < 0), -log_ratio)


@register_policy_loss("cispo", requires=CLIP_RULES)
def cispo(log_prob: Array, old_log_prob: Array, advantages: Array, mask: Array, options: PolicyLossOptions) -> PerToken:
    """CISPO: REINFORCE weighted by the clipped, stop-gradient importance ratio."""
    log_ratio = _clamped_log_ratio(log_prob, old_log_prob)
    ratio = jnp.exp(log_ratio)
    weight = jnp.clip(ratio, 1 - options.low, 1 + options.high)
    loss = -jax.lax.stop_gradient(weight) * advantages * log_prob
    return PerToken(loss, ratio != weight, jnp.zeros_like(mask, dtype=bool), -log_ratio)


@register_policy_loss("gpg")
def gpg(log_prob: Array, old_log_prob: Array, advantages: Array, mask: Array, options: PolicyLossOptions) -> PerToken:
    """GPG: plain policy gradient ``-A logp``, no ratio."""
    no_clip = jnp.zeros_like(mask, dtype=bool)
    return PerToken(-advantages * log_prob, no_clip, no_clip, old_log_prob - log_prob)


@register_policy_loss("sapo", requires=tuple(
    OptionRule(name, lambda value: value > 0, "> 0 (a gate temperature)") for name in ("tau_pos", "tau_neg")
))
def sapo(log_prob: Array, old_log_prob: Array, advantages: Array, mask: Array, options: PolicyLossOptions) -> PerToken:
    """SAPO: a smooth sigmoid gate on the ratio in place of the hard clip."""
    log_ratio = _clamped_log_ratio(log_prob, old_log_prob)
    tau = jnp.where(advantages > 0, options.tau_pos, options.tau_neg).astype(log_prob.dtype)
    gate = jax.nn.sigmoid(tau * (jnp.exp(log_ratio) - 1)) * (4 / tau)
    no_clip = jnp.zeros_like(mask, dtype=bool)
    return PerToken(-gate * advantages, no_clip, no_clip, -log_ratio)


@register_policy_loss(
    "dro", requires=(OptionRule("dro_beta", lambda value: value is not None and value > 0, "> 0 (DRO's penalty)"),)
)
def dro(log_prob: Array, old_log_prob: Array, advantages: Array, mask: Array, options: PolicyLossOptions) -> PerToken:
    """DRO: policy gradient with a quadratic penalty on the log-ratio."""
    beta = options.dro_beta
    log_ratio = log_prob - old_log_prob
    no_clip = jnp.zeros_like(mask, dtype=bool)
    return PerToken(-(advantages * log_prob - 0.5 * beta * jnp.square(log_ratio)), no_clip, no_clip, -log_ratio)


def _dppo(
    log_prob: Array, old_log_prob: Array, advantages: Array, trusted: Array, options: PolicyLossOptions
) -> PerToken:
    """DPPO-Binary surrogate on the tokens inside the trust region, with a truncated stop-gradient ratio."""
    log_ratio = _clamped_log_ratio(log_prob, old_log_prob)
    ratio = jnp.exp(log_ratio)
    weight = jax.lax.stop_gradient(jnp.minimum(ratio, options.clip_ratio_c))
    loss = jnp.where(trusted, -advantages * weight * log_prob, 0)
    return PerToken(loss, ~trusted, trusted & (ratio > options.clip_ratio_c), -log_ratio)


@register_policy_loss("dppo_tv", requires=_DPPO_RULES)
def dppo_tv(
    log_prob: Array, old_log_prob: Array, advantages: Array, mask: Array, options: PolicyLossOptions
) -> PerToken:
    """DPPO-Binary-TV: trust region on the change of the sampled token's probability."""
    change = jnp.exp(log_prob) - jnp.exp(old_log_prob)
    trusted = jnp.where(advantages > 0, change <= options.high, change >= -options.low)
    return _dppo(log_prob, old_log_prob, advantages, trusted, options)


@register_policy_loss("dppo_kl", requires=_DPPO_RULES)
def dppo_kl(
    log_prob: Array, old_log_prob: Array, advantages: Array, mask: Array, options: PolicyLossOptions
) -> PerToken:
    """DPPO-Binary-KL: trust region on the KL between Bernoulli(p_old) and Bernoulli(p) of the sampled token."""
    prob, old_prob = jnp.exp(log_prob), jnp.exp(old_log_prob)
    binary_kl = old_prob * (old_log_prob - log_prob) + (1 - old_prob) * (
        jnp.log(1 - old_prob + _BINARY_KL_EPS) - jnp.log(1 - prob + _BINARY_KL_EPS)
    )
    trusted = jnp.where(
        advantages > 0,
        (binary_kl <= options.high) | (prob <= old_prob),
        (binary_kl <= options.low) | (prob >= old_prob),
    )
    return _dppo(log_prob, old_log_prob, advantages, trusted, options)


def policy_loss(
    name: str,
    log_prob: Array,
    old_log_prob: Array,
    advantages: Array,
    mask: Array,
    *,
    mode: str,
    norm: NormStats,
    weights: Array | None = None,
    **options: float | None,
) -> tuple[Array, dict[str, metrics_lib.Metric]]:
    """This call's share of the whole-mini-batch policy loss of variant ``name``, and its metrics.

    Args:
        name: a key of :data:`POLICY_LOSSES`.
        log_prob, old_log_prob, advantages: ``[batch, length]``; anything (even NaN) where ``mask`` is 0.
        mask: ``[batch, length]`` response mask.
        mode: aggregation mode (see :data:`~jppo.losses.aggregate.AGG_MODES`).
        norm: whole-mini-batch normalizers (see :func:`~jppo.losses.aggregate.agg_loss`).
        weights: optional ``[batch, length]`` stop-gradient factors of the per-token loss, applied before
            aggregation (the rollout correction, :mod:`jppo.losses.rollout_correction`); ``None``: no factor.
        **options: fields of :class:`PolicyLossOptions`.

    Returns:
        ``(share, metrics)`` with metrics ``actor/pg_loss``, ``actor/pg_clipfrac``, ``actor/pg_clipfrac_lower``,
        ``actor/ppo_kl``.
    """
    loss_fn = get_policy_loss(name)
    check_mode(mode)
    parsed = PolicyLossOptions.create(**options)
    check_policy_options(name, parsed)
    log_prob, old_log_prob, advantages = select_valid(
        mask, log_prob=log_prob, old_log_prob=old_log_prob, advantages=advantages
    )
    valid = mask.astype(bool)
    per_token = loss_fn(log_prob, old_log_prob, advantages, valid, parsed)
    loss = per_token.loss if weights is None else per_token.loss * jnp.where(valid, weights, 0)
    share = agg_loss(loss, valid, mode, norm)
    dtype = per_token.loss.dtype
    return share, {
        "actor/pg_loss": metrics_lib.loss_share(share, valid, norm),
        "actor/pg_clipfrac": metrics_lib.ratio(per_token.clipped.astype(dtype), valid),
        "actor/pg_clipfrac_lower": metrics_lib.ratio(per_token.clipped_lower.astype(dtype), valid),
        "actor/ppo_kl": metrics_lib.ratio(per_token.approx_kl.astype(dtype), valid),
    }
