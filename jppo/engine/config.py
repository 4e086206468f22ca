"""Settings of the update engine: frozen dataclasses with verl's names, in the engine's units.

What a user and the engine count alike (micro-batch sizes in sequences per batch shard, as verl's ``*_per_gpu``
sizes; token budgets; epochs; losses; the optimizer) is declared once, in :class:`UpdateFields`,
:class:`ActorFields` and :class:`CriticFields` (:mod:`jppo.core.settings`, where the trainer's config composes
them without loading the engine). Two kinds of config add the rest to them:

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
from jppo.core.settings import NORMALIZATIONS, OLD_LOG_PROB_SOURCES, ActorFields, CriticFields, UpdateFields


@dataclasses.dataclass(frozen=True)
class UpdateConfig(UpdateFields):
    """The engine's config of one update: ``ppo_mini_batch_size`` *sequences* make one optimizer step, and
    ``optimizer_steps_per_training_step`` of them (``ppo_epochs`` x mini-batches) make one training step, the unit
    the learning-rate schedule counts (1: every optimizer step is a schedule step)."""

    ppo_mini_batch_size: int = 8
    optimizer_steps_per_training_step: int = 1
    # the gradient and metrics summed over rows in one fixed order: the same bits on any power-of-two mesh and
    # fixed cut (jppo.engine.bitwise)
    bitwise: bool = False


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


def fixed_micro_batch_count(cfg: UpdateConfig, num_shards: int) -> Optional[int]:
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
