"""Token entropy of the policy and the entropy bonus term.

``H = logsumexp(z) - sum_v softmax(z)_v z_v`` over the vocabulary, computed stably from ``s = z - max(z)`` as
``H = log(sum e) - sum(e s) / sum(e)`` with ``e = exp(s)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jppo.core import metrics as metrics_lib
from jppo.core.masked import NormStats, select_valid
from jppo.losses.aggregate import agg_loss, check_mode

Array = jax.Array


def entropy_from_logits(logits: Array, mask: Array | None = None) -> Array:
    """Per-position entropy ``[..., length]`` of the categorical distributions given by ``logits`` ``[..., V]``.

    Low-precision logits (bfloat16, float16) are computed in float32; float32 and float64 stay as they are. The
    result has the compute dtype.

    What is materialised: the logits are never copied to float32 as such; the upcast, the shift ``s`` and
    ``e = exp(s)`` are elementwise producers of the two reductions over ``V`` (``sum e`` and ``sum e s``), and the
    probabilities ``e / sum e`` are never formed as an array. Whether the producers are fused into the reductions
    is the XLA backend's decision: measured under ``jit`` with XLA:CPU (jax 0.10), forward alone and forward plus
    backward each keep two float32 ``[..., V]`` temporaries (``s`` and ``e``). For a bounded footprint with a
    large vocabulary, call it on chunks of the sequence.

    Vocabulary entries at ``-inf`` (masked tokens) have zero probability and get a zero gradient: the logits are
    floored at their dtype's most negative finite value, so ``e s`` is ``0 * finite`` rather than ``0 * -inf``.

    Args:
        logits: ``[..., length, V]`` unnormalized log-probabilities.
        mask: optional ``[..., length]`` response mask. Where it is 0 the logits are replaced by zeros first, so
            NaN/Inf produced at padded positions reach neither the result nor the gradient.
    """
    dtype = jnp.promote_types(logits.dtype, jnp.float32)
    if mask is not None:
        if mask.shape != logits.shape[:-1]:
            raise ValueError(
                f"mask must have the logits' shape without the vocabulary axis {tuple(logits.shape[:-1])}; "
                f"got {tuple(mask.shape)}"
            )
        logits = jnp.where(mask.astype(bool)[..., None], logits, 0)
    logits = jnp.maximum(logits, jnp.finfo(logits.dtype).min).astype(dtype)
    # H does not depend on the shift (sum_v p_v = 1), so the shift needs no gradient.
    peak = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    shifted = logits - peak
    weights = jnp.exp(shifted)
    total = jnp.sum(weights, axis=-1)
    return jnp.log(total) - jnp.sum(weights * shifted, axis=-1) / total


def entropy_loss(
    entropy: Array,
    mask: Array,
    *,
    mode: str,
    norm: NormStats,
) -> tuple[Array, dict[str, metrics_lib.Metric]]:
    """This call's share of ``agg(entropy)``, and ``actor/entropy`` (the bonus is subtracted by the actor loss).

    ``entropy`` is ``[batch, length]``, e.g. from :func:`entropy_from_logits`; anything (even NaN) where ``mask``
    is 0. ``norm``: the whole mini-batch's normalizers (see :func:`~jppo.losses.aggregate.agg_loss`).
    """
    check_mode(mode)
    (entropy,) = select_valid(mask, entropy=entropy)
    valid = mask.astype(bool)
    share = agg_loss(entropy, valid, mode, norm)
    return share, {"actor/entropy": metrics_lib.loss_share(share, valid, norm)}
