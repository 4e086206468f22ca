"""Settings of the update engine: frozen dataclasses with verl's names, in the engine's units.

What a user and the engine count alike (micro-batch sizes in sequences per batch shard, as verl's ``*_per_gpu``
sizes; token budgets; epochs; losses; the optimizer) is declared once, in :class:`UpdateFields`,
:class:`ActorFields` and :class:`CriticFields`. Two kinds of config add the rest to them:

- the engine's :class:`ActorConfig` and :class:`CriticConfig` (both an :class:`UpdateConfig`):
  ``ppo_mini_batch_size`` counts *sequences* (prompt + one response), and an update needs ``loss_scale_factor``;
- the trainer's config sections (:mod:`jppo.config`): ``ppo_mini_batch_size`` counts *prompts* (verl's
  convention), and ``loss_scale_factor`` may be left to the trainer.

The trainer derives the first from the second once per run (:func:`jppo.config.views.engine_view`); the engine refuses
a config that is not an :class:`UpdateConfig`, so a count of prompts never reaches it.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from jppo.core.errors import InvalidSetting
from jppo.losses.policy import PolicyLossOptions
from jppo.losses.rollout_correction import RolloutCorrection

NORMALIZATIONS = ("global", "per_micro_batch")
# where the engine's PPO ratio takes its old log-probs from (ActorConfig.old_log_prob; the trainer's key
# actor.old_log_prob: auto picks recompute or update, jppo.config.views.old_log_prob_source)
OLD_LOG_PROB_SOURCES = ("recompute", "update", "rollout")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """Optimizer of one model: AdamW (or SGD), warm-up and decay, global-norm clipping of the whole gradient."""

    name: str = "adamw"  # adamw | sgd (plain, no momentum: beta1, beta2, eps and weight_decay unused)
    lr: float = 1e-6  # peak learning rate, reached after warm-up (>= 0)
    weight_decay: float = 0.01  # AdamW's decoupled weight decay, scaled by the learning rate; 0: none
    beta1: float = 0.9  # Adam's decay of the gradient's first moment, in [0, 1)
    beta2: float = 0.999  # Adam's decay of the gradient's second moment, in [0, 1)
    eps: float = 1e-8  # Adam's epsilon, added to the second moment's root (> 0)
    grad_clip: float = 1.0  # max global norm of the accumulated gradient; <= 0 turns clipping off
    # The schedule counts TRAINING steps (verl's unit: its LR scheduler steps once per training step), so the LR is
    # constant over the optimizer steps of one training step (UpdateConfig.optimizer_steps_per_training_step).
    warmup_steps: int = 0  # training steps of the linear warm-up; the LR reaches ``lr`` on the last of them
    lr_schedule: str = "constant"  # after warm-up: "constant" (lr) or "cosine" (down to min_lr_ratio x lr)
    decay_steps: int = 0  # training steps of the cosine decay after warm-up; 0: the trainer's run after warm-up
    min_lr_ratio: float = 0.0  # cosine: the final learning rate as a fraction of lr, in [0, 1]; unused by constant


@dataclasses.dataclass(frozen=True)
class UpdateFields:
    """What actor and critic updates share, in units a user and the engine count alike.

    Each mini-batch is cut on every batch shard into micro-batches of ``ppo_micro_batch_size`` sequences, or, with
    ``use_dynamic_bsz``, packed into micro-batches of at most ``ppo_max_token_len`` tokens. ``normalization:
    per_micro_batch`` is the legacy (split-dependent) behaviour, kept only to compare with old curves.
    """

    ppo_micro_batch_size: int = 1  # sequences per batch shard in one micro-batch (without use_dynamic_bsz)
    use_dynamic_bsz: bool = False  # cut micro-batches by a token budget (ppo_max_token_len) instead of a count
    ppo_max_token_len: int = 4096  # use_dynamic_bsz: most real tokens (prompt + response) per micro-batch on a shard
    ppo_epochs: int = 1  # passes over the step's batch, each cut into mini-batches (one optimizer step each)
    shuffle: bool = True  # a new random order of the sequences every epoch before the mini-batch cut
    loss_agg_mode: str = "token-mean"  # how per-token losses reduce (jppo.losses.aggregate.AGG_MODES)
    # C of seq-mean-token-sum-norm. An update refuses None; in a trainer config None means rollout.max_response_length
    loss_scale_factor: Optional[float] = None
    normalization: str = "global"  # global (the whole mini-batch) | per_micro_batch (legacy, split-dependent)
    log_prob_chunk_size: int = 256  # sequence chunk of the vocabulary projection in log-probs (>= T: one, no remat)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)


@dataclasses.dataclass(frozen=True)
class _PolicyLossName(UpdateFields):
    """The actor's policy loss by name (a base of its own so that the key comes before the loss's options in a
    config, as it always has)."""

    policy_loss: str = "vanilla"  # a name registered in jppo.losses.POLICY_LOSSES


@dataclasses.dataclass(frozen=True)
class ActorFields(PolicyLossOptions, _PolicyLossName):
    """The policy update: a registered policy loss, optional entropy bonus and KL loss to the reference, and the
    correction of the sampler/trainer mismatch (:mod:`jppo.losses.rollout_correction`). The policy loss's options
    (``clip_ratio``, ..., ``dro_beta``) are the fields of :class:`~jppo.losses.policy.PolicyLossOptions`, declared
    there once: a new option is a new field there."""

    entropy_coeff: float = 0.0  # weight of the token entropy subtracted from the loss (an exploration bonus); 0: none
    use_kl_loss: bool = False  # add kl_loss_coef x the KL to the reference policy to the loss (GRPO's KL term)
    kl_loss_coef: float = 0.001  # weight of the KL loss (with use_kl_loss)
    kl_loss_type: str = "low_var_kl"  # the KL estimator of the loss (jppo.losses.kl.KL_KINDS: k1, k2, k3, k3+, ...)
    rollout_correction: RolloutCorrection = dataclasses.field(default_factory=RolloutCorrection)


@dataclasses.dataclass(frozen=True)
class CriticFields(UpdateFields):
    """The value update: clipped value loss."""

    cliprange_value: float = 0.5  # the new value may move this far from the rollout's value before its loss clips


@dataclasses.dataclass(frozen=True)
class UpdateConfig(UpdateFields):
    """The engine's config of one update: ``ppo_mini_batch_size`` *sequences* make one optimizer step, and
    ``optimizer_steps_per_training_step`` of them (``ppo_epochs`` x mini-batches) make one training step, the unit
    the learning-rate schedule counts (1: every optimizer step is a schedule step)."""

    ppo_mini_batch_size: int = 8
    optimizer_steps_per_training_step: int = 1


@dataclasses.dataclass(frozen=True)
class ActorConfig(UpdateConfig, ActorFields):
    """The engine's config of the policy update (see :class:`ActorFields`, :class:`UpdateConfig`).

    ``old_log_prob`` (:data:`OLD_LOG_PROB_SOURCES`) is the PPO ratio's denominator: ``recompute``, the batch's
    ``old_log_prob`` (a forward pass at the sampling weights before the update); ``update``, the update's own
    log-probs under stop-gradient, the same numbers when the update is on-policy, i.e. ONE optimizer step per
    training step (one epoch, one mini-batch), and refused otherwise; ``rollout``, the sampler's
    ``rollout_log_prob`` (verl's bypass mode; no rollout correction on top)."""

    old_log_prob: str = "recompute"  # recompute | update | rollout (see the docstring)


@dataclasses.dataclass(frozen=True)
class CriticConfig(UpdateConfig, CriticFields):
    """The engine's config of the value update (see :class:`CriticFields`, :class:`UpdateConfig`)."""


def check_update(cfg: UpdateFields) -> None:
    """:class:`~jppo.core.errors.InvalidSetting` for the first setting of an update the engine cannot use (the
    optimizer's: :func:`jppo.engine.optim.check_optim`). Sizes are checked whatever they count; the trainer's
    validator runs the same check on its config sections."""
    rules = {
        name: (getattr(cfg, name) > 0, "> 0")
        for name in ("ppo_mini_batch_size", "ppo_micro_batch_size", "ppo_max_token_len", "ppo_epochs",
                     "log_prob_chunk_size", "optimizer_steps_per_training_step")
        if hasattr(cfg, name)
    }
    scale = cfg.loss_scale_factor
    rules["loss_scale_factor"] = (scale is None or scale > 0, "> 0")
    rules["normalization"] = (cfg.normalization in NORMALIZATIONS, f"one of {', '.join(NORMALIZATIONS)}")
    for name, (ok, valid) in rules.items():
        if not ok:
            raise InvalidSetting(f"{type(cfg).__name__}.", name, getattr(cfg, name), valid)


def fixed_micro_batches(cfg: UpdateConfig, num_shards: int) -> Optional[int]:
    """K, the micro-batches of every optimizer step on each of ``num_shards`` batch shards, when the cut fixes it:
    ``ppo_mini_batch_size / num_shards / ppo_micro_batch_size``; None with ``use_dynamic_bsz`` (K then follows
    each mini-batch's token counts)."""
    if cfg.use_dynamic_bsz:
        return None
    return max(cfg.ppo_mini_batch_size // num_shards // cfg.ppo_micro_batch_size, 1)


def require_engine_config(cfg: UpdateFields, *, for_update: bool = False) -> None:
    """``TypeError`` unless ``cfg`` is an :class:`UpdateConfig` (a trainer config section counts prompts). With
    ``for_update``, also what an optimizer step needs: :func:`check_update`, and ``loss_scale_factor`` set."""
    if not isinstance(cfg, UpdateConfig):
        raise TypeError(
            f"the update engine takes an ActorConfig or CriticConfig (mini-batches in sequences), got "
            f"{type(cfg).__name__}; jppo.config.views.engine_view derives one from a trainer config"
        )
    if for_update:
        check_update(cfg)
        if isinstance(cfg, ActorConfig):
            check_old_log_prob(cfg)
        if cfg.loss_scale_factor is None:
            raise InvalidSetting(f"{type(cfg).__name__}.", "loss_scale_factor", None, "set (C of the update)")


def check_old_log_prob(cfg: ActorConfig) -> None:
    """:class:`~jppo.core.errors.InvalidSetting` unless ``cfg.old_log_prob`` can serve its update: ``update`` only
    when the update is on-policy (one epoch, one optimizer step per training step: a second step's own log-probs
    are no longer the sampling policy's), ``rollout`` only without a rollout correction (its ratio against the
    sampler would be 1)."""
    source = cfg.old_log_prob
    if source not in OLD_LOG_PROB_SOURCES:
        raise InvalidSetting("ActorConfig.", "old_log_prob", source, f"one of {', '.join(OLD_LOG_PROB_SOURCES)}")
    if source == "update" and (cfg.ppo_epochs, cfg.optimizer_steps_per_training_step) != (1, 1):
        raise InvalidSetting(
            "ActorConfig.", "old_log_prob", source,
            f"recompute or rollout with {cfg.ppo_epochs} epochs, {cfg.optimizer_steps_per_training_step} optimizer "
            "steps per training step (update: one epoch, one step)",
        )
    if source == "rollout" and cfg.rollout_correction.mode != "none":
        raise InvalidSetting(
            "ActorConfig.", "old_log_prob", source,
            f"recompute with rollout_correction.mode={cfg.rollout_correction.mode!r} (rollout: the ratio is already "
            "against the sampler's log-probs)",
        )
