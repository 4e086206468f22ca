"""The roles' objectives: what each role's loss reads of a batch, its model outputs, and its micro-batch loss.

A loss here is a :data:`LossFn`, ``(model, micro_batch, norm) -> (share, metrics)``: one micro-batch's *share* of
the whole mini-batch loss, every term through :func:`jppo.losses.agg_loss` with the mini-batch's
:class:`~jppo.core.masked.NormStats` ``norm`` (so the shares of all micro-batches and shards sum to the whole loss),
and its :class:`~jppo.core.metrics.Metric` (numerator, denominator) pairs. The actor's is the policy loss, entropy
bonus, KL loss and (with experts) the router's losses; the critic's the clipped value loss; SFT's ``-log p`` of the
demonstration. :mod:`jppo.engine.update` differentiates these shares in one optimizer step; the forward passes
(:mod:`jppo.engine.forward`) read the same model outputs (:func:`policy_outputs`, :func:`value_outputs`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
from flax import nnx

from jppo.core import metrics as metrics_lib
from jppo.core.experience import Experience
from jppo.core.masked import NormStats
from jppo.core.settings import ActorFields, PolicyLossOptions
from jppo.engine.config import ActorConfig, CriticConfig, UpdateConfig
from jppo.engine.experts import replayed, router_aux_coef, router_z_coef
from jppo.engine.layout import flatten_shards, gather_slots, next_token_targets
from jppo.engine.microbatch import MicroBatches
from jppo.losses import actor_loss, sft_loss, value_loss
from jppo.losses.policy import check_policy_options
from jppo.losses.rollout_correction import sampler_mismatch
from jppo.losses.router import expert_load, load_balancing_share, z_loss_share
from jppo.models.log_probs import token_log_probs
from jppo.models.moe import RouterStats, collect_router_stats

Batch = MicroBatches  # one micro-batch [D, ...] or a stack of them [K, D, ...] / [M, K, D, ...], on the devices
LossFn = Callable[[nnx.Module, Batch, NormStats], tuple[jax.Array, dict[str, metrics_lib.Metric]]]


def loss_inputs(cfg: UpdateConfig) -> tuple[str, ...]:
    """The per-token fields of the :class:`~jppo.core.experience.Experience` a role's loss reads (besides the response
    mask): only these travel to its update."""
    if isinstance(cfg, ActorConfig):
        # rollout_log_prob: the rollout_corr/* metrics are reported in every mode (None if a batch lacks it)
        old = ("old_log_prob",) if cfg.old_log_prob == "recompute" else ()  # else the update's own, or the sampler's
        return old + ("advantages", "rollout_log_prob") + (("ref_log_prob",) if cfg.use_kl_loss else ())
    return ("values", "returns")


def slot_inputs(batch: Batch) -> Experience:
    """The response-aligned ``[D, S, L]`` slots of a micro-batch as ``[D * S, L]``."""
    return jax.tree.map(flatten_shards, batch.slots)


def policy_outputs(
    model: nnx.Module, batch: Batch, *, temperature: float, chunk_size: int, with_entropy: bool
) -> tuple[jax.Array, jax.Array | None]:
    """Log-probs (and entropy) of the response tokens of one micro-batch, in slots ``[D * S, L]``."""
    input_ids = flatten_shards(batch.input_ids)
    with replayed(batch):  # routing replay: the batch's recorded experts, if it has them
        log_probs, entropy = token_log_probs(
            model, input_ids, flatten_shards(batch.positions), flatten_shards(batch.segment_ids),
            next_token_targets(input_ids), temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy,
        )
    log_probs = gather_slots(log_probs, batch.gather_index)
    return log_probs, None if entropy is None else gather_slots(entropy, batch.gather_index)


def value_outputs(model: nnx.Module, batch: Batch) -> jax.Array:
    """Value predictions for the states before each response token, in slots ``[D * S, L]``."""
    values = model(flatten_shards(batch.input_ids), flatten_shards(batch.positions), flatten_shards(batch.segment_ids))
    return gather_slots(values, batch.gather_index)


def policy_options(cfg: ActorFields) -> PolicyLossOptions:
    """The policy loss's options out of the actor's settings (which declare them by embedding
    :class:`PolicyLossOptions`): just those fields, hashable, as the loss takes them."""
    return PolicyLossOptions.create(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(PolicyLossOptions)})


def actor_loss_fn(cfg: ActorConfig, temperature: float = 1.0) -> LossFn:
    """The actor's micro-batch loss: policy loss, entropy bonus and KL loss, all with the same NormStats.

    ``temperature`` is the rollout's: log-probs are those of ``logits / temperature``, as sampled. Options the
    policy loss or the rollout correction cannot use are refused here, before anything is traced."""
    options = policy_options(cfg)
    check_policy_options(cfg.policy_loss, options)
    cfg.rollout_correction.check()

    def loss(model, batch, norm):
        with collect_router_stats() as routed:
            log_probs, entropy = policy_outputs(
                model, batch, temperature=temperature, chunk_size=cfg.log_prob_chunk_size, with_entropy=True
            )
        if cfg.entropy_coeff == 0:
            # reported (actor/entropy) whatever the coefficient; without a bonus it needs no backward pass
            entropy = jax.lax.stop_gradient(entropy)
        data, current, source = slot_inputs(batch), jax.lax.stop_gradient(log_probs), cfg.old_log_prob
        old = {"recompute": data.old_log_prob, "update": current, "rollout": data.rollout_log_prob}[source]
        share, metrics = actor_loss(
            log_probs, old, data.advantages, data.response_mask, norm=norm,
            mode=cfg.loss_agg_mode, policy_loss_name=cfg.policy_loss, policy_options=options, entropy=entropy,
            entropy_coeff=cfg.entropy_coeff, ref_log_prob=data.ref_log_prob,
            kl_loss_coef=cfg.kl_loss_coef if cfg.use_kl_loss else 0.0, kl_loss_type=cfg.kl_loss_type,
            rollout_log_prob=None if source == "rollout" else data.rollout_log_prob,
            rollout_correction=cfg.rollout_correction,
        )
        if source != "recompute" and data.rollout_log_prob is not None:  # no pass before the update measured it
            mask, corr = data.response_mask, source == "rollout"
            metrics.update(sampler_mismatch(current, data.rollout_log_prob, mask, rollout_corr=corr))
        if routed:  # a model with experts
            share, metrics = with_router_losses(share, metrics, routed[0], cfg, model.config, norm, "actor")
        return share, metrics

    return loss


def with_router_losses(share: jax.Array, metrics: dict, stats: RouterStats, cfg: UpdateConfig, model_config,
                       norm: NormStats, role: str) -> tuple[jax.Array, dict]:
    """``share`` plus a model with experts' router terms, and ``metrics`` with theirs under ``role/``:
    ``aux_coef x`` the load-balancing loss's share (from the whole mini-batch's expert fractions in ``norm``) and
    ``z_coef x`` the z-loss's share (the mean over the mini-batch's (token, layer with experts) pairs of
    ``logsumexp(router logits)^2``), each reported when its weight is not 0; ``role/expert_load`` (the max over
    the mean of the tokens per expert) always. ``stats``: this micro-batch's, stacked over the layers with
    experts."""
    metrics = dict(metrics, **{f"{role}/expert_load": expert_load(stats.counts, stats.tokens)})
    coef = router_aux_coef(cfg, model_config)
    if coef:
        aux, metrics[f"{role}/router_aux_loss"] = load_balancing_share(stats.counts, stats.probs, stats.tokens, norm)
        share = share + coef * aux
    z_coef = router_z_coef(cfg, model_config)
    if z_coef:
        z, metrics[f"{role}/router_z_loss"] = z_loss_share(stats.z, stats.tokens, norm)
        share = share + z_coef * z
    return share, metrics


def critic_loss_fn(cfg: CriticConfig) -> LossFn:
    """The critic's micro-batch loss: the clipped value loss, and, on a decoder with experts, the router's losses
    (the critic routes by its own router: routing replay is the policy's)."""

    def loss(model, batch, norm):
        with collect_router_stats() as routed:
            vpreds = value_outputs(model, batch)
        data = slot_inputs(batch)
        share, metrics = value_loss(
            vpreds, data.values, data.returns, data.response_mask, cliprange_value=cfg.cliprange_value,
            mode=cfg.loss_agg_mode, norm=norm,
        )
        if routed:
            share, metrics = with_router_losses(share, metrics, routed[0], cfg, model.config, norm, "critic")
        return share, metrics

    return loss


def sft_loss_fn(cfg: ActorConfig) -> LossFn:
    """Supervised fine-tuning's micro-batch loss: ``-log p`` of the masked tokens (a completion, every assistant
    turn) through ``agg_loss`` with the whole mini-batch's NormStats (:func:`jppo.losses.sft.sft_loss`)."""

    def loss(model, batch, norm):
        with collect_router_stats() as routed:
            log_probs, _ = policy_outputs(model, batch, temperature=1.0, chunk_size=cfg.log_prob_chunk_size,
                                          with_entropy=False)
        share, metrics = sft_loss(log_probs, slot_inputs(batch).response_mask, mode=cfg.loss_agg_mode, norm=norm)
        if routed:  # a model with experts: the same router losses as in RL, under the sft/ prefix
            share, metrics = with_router_losses(share, metrics, routed[0], cfg, model.config, norm, "sft")
        return share, metrics

    return loss
