"""A mixture-of-experts model's load-balancing loss in the update: its weight, and the whole mini-batch's expert
fractions that every micro-batch's share of the loss uses (:mod:`jppo.losses.router`), so the loss and its
gradient do not depend on how the mini-batch was cut; and routing replay's record put in force for a micro-batch's
forward pass."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jppo.engine.config import ActorConfig, CriticConfig, UpdateConfig
from jppo.engine.layout import flatten_shards
from jppo.engine.microbatch import MicroBatches
from jppo.models.attention import by_product
from jppo.models.moe import collect_router_stats, replay_routing


def router_aux_coef(cfg: UpdateConfig, model_config) -> float:
    """The load-balancing loss's weight: the role's ``router_aux_loss_coef`` (``actor.``, ``critic.``; SFT reads
    the actor's), by default the model's; 0 for a model without a layer with experts."""
    if not isinstance(cfg, (ActorConfig, CriticConfig)) or not model_config.sparse_layers:
        return 0.0
    return float(model_config.router_aux_loss_coef if cfg.router_aux_loss_coef is None else cfg.router_aux_loss_coef)


def router_z_coef(cfg: UpdateConfig, model_config) -> float:
    """The router z-loss's weight: the role's ``router_z_loss_coef``; 0 for a model without a layer with experts."""
    if not isinstance(cfg, (ActorConfig, CriticConfig)) or not model_config.sparse_layers:
        return 0.0
    return float(cfg.router_z_loss_coef)


def mini_batch_expert_fractions(model: nnx.Module, batch: MicroBatches, replay: bool) -> tuple[jax.Array, jax.Array]:
    """``(f [E], R)`` of the whole mini-batch (:mod:`jppo.losses.router`): a forward pass over its K
    micro-batches, one at a time, that keeps only the router's counts (sums over global arrays: global); routed by
    the batch's record where ``replay`` (the policy's; a critic routes by its own router)."""

    def counts(micro):
        with collect_router_stats() as routed, replayed(micro if replay else None):
            model.hidden_states(flatten_shards(micro.input_ids), flatten_shards(micro.positions),
                                flatten_shards(micro.segment_ids))
        return jnp.sum(routed[0].counts, axis=0), jnp.sum(routed[0].tokens)

    if by_product():  # bitwise (no replay): one row per shard a pass, routed as the update's rows route them
        rows = lambda x: jnp.swapaxes(x, 1, 2).reshape(-1, x.shape[1], 1, *x.shape[3:])  # noqa: E731 [K R, D, 1, W]
        batch = dataclasses.replace(batch, input_ids=rows(batch.input_ids), positions=rows(batch.positions),
                                    segment_ids=rows(batch.segment_ids), gather_index=None, slots=None)
    per_expert, pairs = jax.tree.map(lambda x: jnp.sum(x, axis=0), jax.lax.map(counts, batch))
    return jax.lax.stop_gradient(per_expert / jnp.maximum(pairs, 1)), pairs


def replayed(batch: MicroBatches | None):
    """:func:`~jppo.models.moe.replay_routing` of one micro-batch's recorded experts (``[D, R, W, Ls, k]``, the
    token rows' layout), or of none: a batch without a record routes by its own router."""
    routed = None if batch is None else batch.routed_experts
    return replay_routing(None if routed is None else flatten_shards(routed))
