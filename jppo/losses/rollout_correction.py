"""Rollout/trainer mismatch correction: weights on the policy-gradient term from the sampler's own log-probs.

The sampler (KV cache, its own kernels, maybe another dtype) and the trainer's forward pass compute slightly
different probabilities for the same tokens, so the "on-policy" samples are really drawn from the sampler's policy
``pi_roll``, not from the trainer's ``pi_old``. Per response token ``t`` of row ``i``, with ``logp_old`` the
trainer's log-prob at the start of the update and ``logp_roll`` the sampler's:

    d_t = logp_old_t - logp_roll_t,    r_t = exp(clip(d_t, -20, 20))     (pi_old / pi_roll; the clamp guards exp)

and, per row, the mean over its valid tokens ``dbar_i = mean_t d_t`` (0 for an empty row), whose exponential
``g_i = exp(dbar_i)`` is the geometric mean of the row's ratios. Modes (``tau`` is ``threshold``; weights are
stop-gradient):

- ``none``: no weight; the policy loss is exactly the uncorrected one.
- ``token_tis`` (truncated importance sampling per token): ``w_t = min(r_t, tau)``, ``tau > 0``.
- ``seq_tis`` (per sequence): ``w_t = min(g_i, tau)`` on every token of row ``i``, ``tau > 0``.
- ``seq_mask`` (rejection per sequence): ``w_t = 1`` if ``1/tau <= g_i <= tau`` (compared in log space,
  ``|dbar_i| <= log tau``), else 0, ``tau > 1``.

The policy loss multiplies its per-token loss by ``w`` before :func:`~jppo.losses.aggregate.agg_loss`, with the same
:class:`~jppo.masked.NormStats` as every other term. A sequence rejected by ``seq_mask`` weighs 0 in the numerator
but stays in the denominator (N and S count the response mask): every loss term shares one NormStats (the
contract's section 3), so dropping it from the policy term's denominator alone would give that term its own
normalizer, and the step is scaled like an uncorrected one (a rejected sequence acts as tokens with zero gradient,
as PPO-clipped tokens do). Each weight is a function of one row's data only, and rows are never split across
micro-batches, so the weighted loss is split-invariant like the unweighted one.

Metrics (whenever rollout log-probs are given, whatever the mode), whole-batch :class:`~jppo.metrics.Metric` pairs:
``rollout_corr/kl`` the k1 estimate of KL(pi_roll || pi_old), ``mean_t (logp_roll_t - logp_old_t)`` over the
response tokens (tokens are sampled from pi_roll); ``rollout_corr/ratio_mean`` the token mean of ``r_t``;
``rollout_corr/masked_fraction`` the fraction of non-empty sequences ``seq_mask`` rejects (0 in other modes).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jppo import metrics as metrics_lib
from jppo.errors import InvalidSetting
from jppo.masked import masked_mean, select_valid

Array = jax.Array

ROLLOUT_CORRECTION_MODES: tuple[str, ...] = ("none", "token_tis", "seq_tis", "seq_mask")
# exp(20) ~ 5e8: keeps the token ratio finite (the same bound as the policy losses' log-ratio clamp).
_LOG_RATIO_BOUND = 20.0


@dataclasses.dataclass(frozen=True)
class RolloutCorrection:
    """How the policy loss corrects for the sampler's policy differing from the trainer's (module docstring).

    Attributes:
        mode: one of :data:`ROLLOUT_CORRECTION_MODES`.
        threshold: ``tau``: the truncation of the TIS weights (> 0), or the acceptance band ``[1/tau, tau]`` of
            the geometric-mean ratio for ``seq_mask`` (> 1). Unused by ``none``.
    """

    mode: str = "none"
    threshold: float = 2.0

    def check(self) -> None:
        """:class:`~jppo.errors.InvalidSetting` naming the first setting the mode cannot use."""
        if self.mode not in ROLLOUT_CORRECTION_MODES:
            raise InvalidSetting("rollout_correction.", "mode", self.mode, f"one of {', '.join(ROLLOUT_CORRECTION_MODES)}")
        if self.mode == "seq_mask" and not self.threshold > 1:
            raise InvalidSetting("rollout_correction.", "threshold", self.threshold, "> 1 for mode 'seq_mask'")
        if self.mode in ("token_tis", "seq_tis") and not self.threshold > 0:
            raise InvalidSetting("rollout_correction.", "threshold", self.threshold, f"> 0 for mode {self.mode!r}")


def rollout_weights(
    old_log_prob: Array, rollout_log_prob: Array, mask: Array, correction: RolloutCorrection
) -> tuple[Array | None, dict[str, metrics_lib.Metric]]:
    """The stop-gradient ``[batch, length]`` weights of the policy-gradient term (``None`` for mode ``none``) and
    the ``rollout_corr/*`` metrics of these rows. Inputs may be anything (NaN) where ``mask`` is 0."""
    correction.check()
    valid = mask.astype(bool)
    old_log_prob, rollout_log_prob = select_valid(mask, old_log_prob=old_log_prob, rollout_log_prob=rollout_log_prob)
    old_log_prob = jax.lax.stop_gradient(old_log_prob)
    log_ratio = old_log_prob - rollout_log_prob
    ratio = jnp.exp(jnp.clip(log_ratio, -_LOG_RATIO_BOUND, _LOG_RATIO_BOUND))
    row_log_ratio = masked_mean(log_ratio, valid, axis=-1)[:, None]
    tau = correction.threshold
    rejected = jnp.zeros_like(row_log_ratio, dtype=bool)
    if correction.mode == "token_tis":
        weights = jnp.minimum(ratio, tau)
    elif correction.mode == "seq_tis":
        row_ratio = jnp.exp(jnp.clip(row_log_ratio, -_LOG_RATIO_BOUND, _LOG_RATIO_BOUND))
        weights = jnp.broadcast_to(jnp.minimum(row_ratio, tau), log_ratio.shape)
    elif correction.mode == "seq_mask":
        rejected = jnp.abs(row_log_ratio) > math.log(tau)
        weights = jnp.broadcast_to(jnp.where(rejected, 0.0, 1.0).astype(log_ratio.dtype), log_ratio.shape)
    else:
        weights = None
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
