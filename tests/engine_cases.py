"""Shared inputs of the engine tests: a tiny model, a ragged mini-batch, and a from-scratch whole-batch reference.

The reference never goes through the engine: it runs the model once over the whole mini-batch in the rollout's
own padded layout, takes log-probs from the full logits, aggregates with the counts of its own mask (the call
sees the whole batch, so local counts are the global ones) and applies the inner optimizer once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jppo.core.experience import Experience
from jppo.engine import ActorConfig, CriticConfig
from jppo.engine.objectives import policy_options
from jppo.engine.optim import inner_optimizer
from jppo.losses import actor_loss, value_loss
from jppo.models.config import ModelConfig
from jppo.parallel.mesh import make_mesh

VOCAB = 48


def mesh_of(shape):
    """A mesh of ``shape`` (data, fsdp, tensor[, sequence]) on the first devices it needs."""
    return make_mesh(*shape, devices=jax.devices()[: int(np.prod(shape))])


def tiny_config(dtype: str = "float64") -> ModelConfig:
    return ModelConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
        dtype=dtype, param_dtype=dtype,
    )


def ragged_batch(seed: int, n: int = 16, p: int = 5, length: int = 6, equal: bool = False) -> Experience:
    """Ragged prompts and responses, an empty response, a single-token one, a loss-mask hole, advantages and
    old/ref log-probs, values and returns. ``equal``: every row has the same lengths (legacy-inflation test)."""
    rng = np.random.default_rng(seed)
    prompt_len = np.full(n, p) if equal else rng.integers(1, p + 1, n)
    response_len = np.full(n, length) if equal else rng.integers(1, length + 1, n)
    if not equal:
        response_len[0], response_len[1] = 0, 1
    prompt_mask = np.arange(p)[None, :] >= (p - prompt_len)[:, None]
    attention = np.arange(length)[None, :] < response_len[:, None]
    response_mask = attention.copy()
    if not equal:
        response_mask[2, 0] = response_len[2] < 2  # an interior hole (kept valid if it is the only token)
    per_token = {
        "old_log_prob": np.where(attention, -rng.uniform(2.5, 4.5, (n, length)), 0.0),
        "ref_log_prob": np.where(attention, -rng.uniform(2.5, 4.5, (n, length)), 0.0),
        "advantages": np.where(attention, rng.normal(size=(n, length)), 0.0),
        "values": np.where(attention, rng.normal(size=(n, length)), 0.0),
        "returns": np.where(attention, rng.normal(size=(n, length)), 0.0),
    }
    return Experience(
        np.where(prompt_mask, rng.integers(1, VOCAB, (n, p)), 0), prompt_mask,
        np.where(attention, rng.integers(1, VOCAB, (n, length)), 0), response_mask, attention, **per_token,
    )


def padded_inputs(batch: Experience):
    """Token ids, positions and segment ids ``[N, P + L]`` of the rows in the rollout's own padded layout."""
    real = np.concatenate([batch.prompt_mask, batch.response_attention], axis=1)
    ids = np.where(real, np.concatenate([batch.prompt_ids, batch.response_ids], axis=1), 0)
    positions = np.maximum(np.cumsum(real, axis=1) - 1, 0)
    return jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(real.astype(np.int32))


def reference_actor_loss(model, batch: Experience, cfg: ActorConfig, loss_scale_factor: float):
    ids, positions, segments = padded_inputs(batch)
    p, length = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    logits = model(ids, positions, segments)
    # position p - 1 + j predicts response token j
    window = jax.nn.log_softmax(
        logits[:, p - 1 : p - 1 + length].astype(jnp.float64 if logits.dtype == jnp.float64 else jnp.float32), axis=-1
    )
    log_prob = jnp.take_along_axis(window, ids[:, p : p + length, None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(window) * window, axis=-1)
    data = jax.tree.map(lambda v: jnp.asarray(v, log_prob.dtype), batch.per_token())
    mask = jnp.asarray(batch.response_mask)
    options = policy_options(cfg)
    from jppo.core.masked import global_norm_stats

    norm = global_norm_stats(mask, loss_scale_factor, dtype=log_prob.dtype)
    return actor_loss(
        log_prob, data.old_log_prob, data.advantages, mask, norm=norm, mode=cfg.loss_agg_mode,
        policy_loss_name=cfg.policy_loss, policy_options=options,
        entropy=entropy if cfg.entropy_coeff else None, entropy_coeff=cfg.entropy_coeff,
        ref_log_prob=data.ref_log_prob if cfg.use_kl_loss else None,
        kl_loss_coef=cfg.kl_loss_coef if cfg.use_kl_loss else 0.0, kl_loss_type=cfg.kl_loss_type,
        rollout_log_prob=data.rollout_log_prob, rollout_correction=cfg.rollout_correction,
    )


def reference_critic_loss(model, batch: Experience, cfg: CriticConfig, loss_scale_factor: float):
    ids, positions, segments = padded_inputs(batch)
    p, length = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    vpreds = model(ids, positions, segments)[:, p - 1 : p - 1 + length]
    data = jax.tree.map(lambda v: jnp.asarray(v, vpreds.dtype), batch.per_token())
    mask = jnp.asarray(batch.response_mask)
    from jppo.core.masked import global_norm_stats

    norm = global_norm_stats(mask, loss_scale_factor, dtype=vpreds.dtype)
    return value_loss(
        vpreds, data.values, data.returns, mask, cliprange_value=cfg.cliprange_value, mode=cfg.loss_agg_mode,
        norm=norm,
    )


def reference_step(model, batch: Experience, cfg, loss_scale_factor: float):
    """Parameters after one optimizer step on the whole mini-batch, its gradient, and its loss."""
    graphdef, params = nnx.split(model, nnx.Param)
    loss = reference_actor_loss if isinstance(cfg, ActorConfig) else reference_critic_loss
    (value, metrics), grads = jax.value_and_grad(
        lambda p: loss(nnx.merge(graphdef, p), batch, cfg, loss_scale_factor), has_aux=True
    )(params)
    tx = inner_optimizer(cfg.optim)
    updates, _ = tx.update(grads, tx.init(params), params, optimizer_step=0)  # the first optimizer step
    return optax.apply_updates(params, updates), grads, value, metrics
