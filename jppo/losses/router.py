"""The load-balancing loss of a mixture of experts, as a share of the whole mini-batch's, and the router's metrics.

Over the whole mini-batch, with ``R`` its (non-padding token, layer with experts) pairs, ``c_e`` the pairs routed to
expert ``e`` (each token to ``k`` experts) and ``p_e`` the router's probability of ``e`` summed over the pairs:

    aux = E sum_e f_e P_e,    f_e = c_e / R,    P_e = p_e / R

(transformers' ``load_balancing_loss_func``: Switch Transformer's loss, pooled over the layers; ``k`` when the load
is even). ``f_e`` is a count, with no gradient, and the only factor that is not a sum over tokens: taken from the
whole mini-batch (:attr:`~jppo.core.masked.NormStats.expert_fractions`, computed before the micro-batches), the
micro-batch shares ``E sum_e f_e p_e(micro) / R`` sum to ``aux`` whatever the cut, and so do their gradients. A
product of two micro-batch averages would not.

The router's z-loss (ST-MoE's) is a plain mean over the same pairs, of the squared ``logsumexp`` of the router's
logits ``l``:

    z = (1 / R) sum_pairs logsumexp(l)^2

so a micro-batch's share is its own sum over the whole mini-batch's ``R`` (:func:`z_loss_share`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jppo.core.masked import NormStats, safe_divide
from jppo.core.metrics import Metric

Array = jax.Array


def load_balancing_share(counts: Array, probs: Array, tokens: Array, norm: NormStats | None) -> tuple[Array, Metric]:
    """This micro-batch's share of the whole mini-batch's ``aux`` and its metric pair (share, weight: the
    micro-batch's fraction of ``R``), from its router stats per layer with experts: ``counts``/``probs [layers, E]``
    and ``tokens [layers]`` (:class:`~jppo.models.moe.RouterStats`).

    Without ``norm.expert_fractions`` (``norm`` None, or the legacy per-micro-batch mode) the fractions and ``R``
    are this call's own: correct only for a call that sees the whole mini-batch."""
    num_experts = counts.shape[-1]
    local_pairs = jnp.sum(tokens)
    if norm is None or norm.expert_fractions is None:
        fractions, pairs = safe_divide(jnp.sum(counts, axis=0), local_pairs), local_pairs
    else:
        fractions, pairs = norm.expert_fractions, norm.routed_pairs
    share = num_experts * safe_divide(jnp.sum(jax.lax.stop_gradient(fractions) * jnp.sum(probs, axis=0)), pairs)
    return share, Metric(share, safe_divide(local_pairs, pairs))


def z_loss_share(z: Array, tokens: Array, norm: NormStats | None) -> tuple[Array, Metric]:
    """This micro-batch's share of the whole mini-batch's z-loss and its metric pair (share, weight: the
    micro-batch's fraction of ``R``), from its router stats per layer with experts: ``z [layers]`` (the sums of
    ``logsumexp(logits)^2``) and ``tokens [layers]``. Without ``norm.routed_pairs`` (``norm`` None, or the legacy
    per-micro-batch mode) ``R`` is this call's own."""
    local_pairs = jnp.sum(tokens)
    pairs = local_pairs if norm is None or norm.routed_pairs is None else norm.routed_pairs
    share = safe_divide(jnp.sum(z), pairs)
    return share, Metric(share, safe_divide(local_pairs, pairs))


def expert_load(counts: Array, tokens: Array) -> Metric:
    """The pairs routed to each expert of each layer, as a metric to report under a key ending in
    ``expert_load``: summed over micro-batches, it finishes as ``max_e c_e / mean_e c_e`` of the most unevenly
    loaded layer (1: even; ``E / k``: every token to the same ``k`` experts)."""
    return Metric(counts, jnp.sum(tokens))
