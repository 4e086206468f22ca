"""The supervised fine-tuning loss: the negative log-likelihood of the demonstration's tokens.

With ``m`` the loss mask (a completion's tokens, every assistant turn of a chat) and ``log p`` the model's
log-probability of each token given those before it, the per-token loss is ``l = -log p`` under ``m`` and the
micro-batch's share is ``agg_loss(l, m, mode, norm)``: ``token-mean`` gives ``sum m l / N`` over the whole
mini-batch's N tokens, ``seq-mean-token-mean`` the mean over its rows of each row's token mean. The same
aggregation as every RL loss term, so the gradient does not depend on how the mini-batch was cut.
"""

from __future__ import annotations

import jax

from jppo.core import metrics as metrics_lib
from jppo.core.masked import NormStats, sanitize
from jppo.losses.aggregate import agg_loss, check_mode

Array = jax.Array


def sft_loss(
    log_prob: Array, mask: Array, *, mode: str, norm: NormStats
) -> tuple[Array, dict[str, metrics_lib.Metric]]:
    """This micro-batch's share of the whole-mini-batch SFT loss, and its metric pairs: ``sft/loss`` (the
    objective ``agg(-log p)``) and ``sft/nll`` (the token-mean ``-log p`` whatever the mode; perplexity is its
    exponential). ``log_prob`` may be anything (even -inf or NaN) where ``mask`` is 0."""
    check_mode(mode)
    valid = mask.astype(bool)
    nll = -sanitize(log_prob, valid)  # sanitized before use: a padded -inf must not reach the gradient
    share = agg_loss(nll, valid, mode, norm)
    return share, {"sft/loss": metrics_lib.loss_share(share, valid, norm), "sft/nll": metrics_lib.ratio(nll, valid)}
