"""Rollout/trainer mismatch correction: weights on the policy-gradient term, or rejected sequences, from the
sampler's own log-probs.

The sampler (KV cache, its own kernels, maybe another dtype) and the trainer's forward pass compute slightly
different probabilities for the same tokens, so the "on-policy" samples are really drawn from the sampler's policy
``pi_roll``, not from the trainer's ``pi_old``. Per response token ``t`` of row ``i``, with ``logp_old`` the
trainer's log-prob at the start of the update and ``logp_roll`` the sampler's:

    d_t = logp_old_t - logp_roll_t,    r_t = exp(clip(d_t, -20, 20))     (pi_old / pi_roll; the clamp guards exp)

and, per row, two aggregates of the row's valid tokens (both 0 for an empty row, :func:`row_log_ratio`): the
sum ``D_i = sum_t d_t``, whose exponential ``exp(D_i) = prod_t r_t`` is the sequence's likelihood ratio, and the
mean ``dbar_i = D_i / n_i``, whose exponential ``g_i`` is the geometric mean of the row's ratios. ``seq_*`` modes
use the product, as verl's ``sequence`` level does; ``geo_*`` modes the geometric mean, as verl's ``geometric``
level does. Modes (``tau`` is ``threshold``; weights are stop-gradient):

- ``none``: no weight; the policy loss is exactly the uncorrected one.
- ``token_tis`` (truncated importance sampling per token): ``w_t = min(r_t, tau)``, ``tau > 0``.
- ``seq_tis`` (per sequence, verl's ``rollout_is: sequence``): ``w_t = min(exp(clip(D_i, -20, 20)), tau)`` on every
  token of row ``i``, ``tau > 0``. Unbiased before truncation, but its spread grows with the length.
- ``geo_tis``: ``w_t = min(g_i, tau)``, ``tau > 0``: length-normalized, so a long row is not all but ignored.
- ``seq_rs`` / ``geo_rs`` (rejection, verl's ``rollout_rs: sequence`` / ``geometric``): a row whose
  ``exp(D_i)`` / ``g_i`` lies outside ``[1/tau, tau]`` (compared in log space, ``|clip(D_i, -20, 20)| > log tau``)
  is removed from the batch at collection: its response mask is cleared (:func:`rejected_rows`, applied by
  :func:`jppo.run.filters.rejected_rows_cleared` after the advantages, as the overlong filter is), so every loss term
  and both normalizers N and S exclude it, as in verl. No weight in the loss. ``tau > 1``.
- ``geo_mask`` (rejection inside the policy term): ``w_t = 0`` on a row whose ``g_i`` lies outside
  ``[1/tau, tau]``, else 1, ``tau > 1``. The row stays in N and S and in the entropy and KL terms (a rejected
  sequence acts as tokens with zero policy gradient, as PPO-clipped tokens do), so the step is scaled like an
  uncorrected one; ``geo_rs`` is the same test with the row removed everywhere.

The policy loss multiplies its per-token loss by ``w`` before :func:`~jppo.losses.aggregate.agg_loss`, with the same
:class:`~jppo.core.masked.NormStats` as every other term. Each weight and each rejection is a function of one row's data
only, and rows are never split across micro-batches; the rejections are applied to the mask before the batch is
cut, so N and S are whole-batch counts of the kept rows: the corrected loss is split-invariant like the plain one.

Metrics (whenever rollout log-probs are given, whatever the mode), whole-batch :class:`~jppo.core.metrics.Metric` pairs:
``rollout_corr/kl`` the k1 estimate of KL(pi_roll || pi_old), ``mean_t (logp_roll_t - logp_old_t)`` over the
response tokens (tokens are sampled from pi_roll); ``rollout_corr/ratio_mean`` the token mean of ``r_t``;
``rollout_corr/masked_fraction`` the fraction of non-empty sequences ``geo_mask`` weighs 0 (0 in other modes).
With ``seq_rs`` / ``geo_rs`` these cover the kept rows, and collection reports ``rollout_corr/rejected_fraction``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jppo.core import metrics as metrics_lib
from jppo.core.masked import masked_mean, masked_sum, select_valid
from jppo.core.settings import REJECTION_MODES, RolloutCorrection

Array = jax.Array

_ROW_LEVEL = {"seq_tis": "seq", "geo_tis": "geo", "seq_rs": "seq", "geo_rs": "geo", "geo_mask": "geo"}
# exp(20) ~ 5e8: keeps the token ratio finite (the same bound as the policy losses' log-ratio clamp).
_LOG_RATIO_BOUND = 20.0


def _bounded_exp(log_ratio: Array) -> Array:
    return jnp.exp(jnp.clip(log_ratio, -_LOG_RATIO_BOUND, _LOG_RATIO_BOUND))


def row_log_ratio(log_ratio: Array, valid: Array, level: str) -> Array:
    """``[batch, 1]``: the log of a row's sequence ratio, ``D_i = sum_t d_t`` (``level='seq'``: the log of the
    product of its token ratios) or ``dbar_i = D_i / n_i`` (``'geo'``: the log of their geometric mean); 0 for an
    empty row. ``log_ratio`` must be finite where ``valid`` is set."""
    reduce = masked_sum if level == "seq" else masked_mean
    return reduce(log_ratio, valid, axis=-1)[:, None]


def _outside_band(row_log: Array, tau: float) -> Array:
    """``exp(clip(row_log)) not in [1/tau, tau]``, compared in log space (exact at any length)."""
    return jnp.abs(jnp.clip(row_log, -_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)) > math.log(tau)


def _log_ratio(old_log_prob: Array, rollout_log_prob: Array, mask: Array) -> Array:
    """``d = logp_old - logp_roll`` (stop-gradient on ``logp_old``), 0 where ``mask`` is 0."""
    old_log_prob, rollout_log_prob = select_valid(mask, old_log_prob=old_log_prob, rollout_log_prob=rollout_log_prob)
    return jax.lax.stop_gradient(old_log_prob) - rollout_log_prob


def rejected_rows(old_log_prob: Array, rollout_log_prob: Array, mask: Array, correction: RolloutCorrection) -> Array:
    """``[batch]`` bool: the rows ``seq_rs`` / ``geo_rs`` remove (all False in the other modes; never an empty row,
    whose ratio is 1). Inputs may be anything (NaN) where ``mask`` is 0."""
    correction.check()
    if correction.mode not in REJECTION_MODES:
        return jnp.zeros(mask.shape[:1], bool)
    valid = mask.astype(bool)
    row_log = row_log_ratio(_log_ratio(old_log_prob, rollout_log_prob, mask), valid, _ROW_LEVEL[correction.mode])
    return _outside_band(row_log, correction.threshold)[:, 0]


def rollout_weights(
    old_log_prob: Array, rollout_log_prob: Array, mask: Array, correction: RolloutCorrection
) -> tuple[Array | None, dict[str, metrics_lib.Metric]]:
    """The stop-gradient ``[batch, length]`` weights of the policy-gradient term (``None`` for ``none`` and the
    rejection modes, whose rows are already out of ``mask``) and the ``rollout_corr/*`` metrics of these rows.
    Inputs may be anything (NaN) where ``mask`` is 0."""
    correction.check()
    valid = mask.astype(bool)
    log_ratio = _log_ratio(old_log_prob, rollout_log_prob, mask)
    ratio = _bounded_exp(log_ratio)
    tau = correction.threshold
    rejected = jnp.zeros((mask.shape[0], 1), bool)
    weights = None
    if correction.mode == "token_tis":
        weights = jnp.minimum(ratio, tau)
    elif correction.mode in ("seq_tis", "geo_tis"):
        row_ratio = _bounded_exp(row_log_ratio(log_ratio, valid, _ROW_LEVEL[correction.mode]))
        weights = jnp.broadcast_to(jnp.minimum(row_ratio, tau), log_ratio.shape)
    elif correction.mode == "geo_mask":
        rejected = _outside_band(row_log_ratio(log_ratio, valid, "geo"), tau)
        weights = jnp.broadcast_to(jnp.where(rejected, 0.0, 1.0).astype(log_ratio.dtype), log_ratio.shape)
    sequences = jnp.any(valid, axis=-1)
    dtype = log_ratio.dtype
    metrics = {
        "rollout_corr/kl": metrics_lib.ratio(-log_ratio, valid),
        "rollout_corr/ratio_mean": metrics_lib.ratio(ratio, valid),
        "rollout_corr/masked_fraction": metrics_lib.Metric(
            jnp.sum(rejected[:, 0] & sequences, dtype=dtype), jnp.sum(sequences, dtype=dtype)
        ),
    }
    return (None if weights is None else jax.lax.stop_gradient(weights)), metrics


def sampler_mismatch(
    log_prob: Array, rollout_log_prob: Array, mask: Array, *, rollout_corr: bool
) -> dict[str, metrics_lib.Metric]:
    """The sampler/trainer mismatch as an update measures it when no forward pass before it computed the old
    log-probs (``old_log_prob: update`` or ``rollout``), from its own stop-gradient ``log_prob``:
    ``rollout/log_prob_abs_diff``, the token mean of ``|logp - logp_roll|`` (what collection reports otherwise);
    with ``rollout_corr`` (the old log-probs ARE the sampler's, so their own ratio is 1), also the ``rollout_corr/*``
    metrics of :func:`rollout_weights` of ``logp`` against ``logp_roll``. Inputs may be anything where ``mask`` is 0."""
    log_prob, rollout_log_prob = select_valid(mask, log_prob=log_prob, rollout_log_prob=rollout_log_prob)
    valid = mask.astype(bool)
    metrics = {"rollout/log_prob_abs_diff": metrics_lib.ratio(jnp.abs(log_prob - rollout_log_prob), valid)}
    if rollout_corr:
        metrics.update(rollout_weights(log_prob, rollout_log_prob, mask, RolloutCorrection())[1])
    return metrics
