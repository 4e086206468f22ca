"""What a run's parts are given of its :class:`~jppo.config.TrainConfig`, derived once, in their own units.

The config counts as its user writes (verl's convention): ``actor.ppo_mini_batch_size`` is a number of *prompts*,
``loss_scale_factor: null`` means the maximum response length, ``optim.decay_steps: 0`` means the rest of the run,
and ``optim.warmup_steps`` / ``optim.decay_steps`` count training steps.
The engine counts *sequences* (prompt + one response; ``rollout.n`` of them per prompt) and needs every constant
resolved. :func:`engine_view` is the one place that converts; the trainer, the audit and the validator's mesh
checks all take the engine's config from it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from jppo.engine.config import ActorConfig, CriticConfig

if TYPE_CHECKING:  # jppo.config imports the validator, which imports this module
    from jppo.config import TrainConfig

ENGINE_CONFIGS = {"actor": ActorConfig, "critic": CriticConfig}


def rollout_sequences(cfg: TrainConfig) -> int:
    """Sequences of one training step: ``data.train_batch_size`` prompts x ``rollout.n`` responses each."""
    return cfg.data.train_batch_size * cfg.rollout.n


def optimizer_steps_per_training_step(cfg: TrainConfig, role: str) -> int:
    """Optimizer steps ``role`` (``actor``/``critic``) takes in one training step: ``ppo_epochs`` passes over the
    mini-batches of the rollout batch."""
    section = getattr(cfg, role)
    return section.ppo_epochs * (cfg.data.train_batch_size // section.ppo_mini_batch_size)


def training_steps(cfg: TrainConfig, role: str) -> int:
    """Training steps in which ``role`` updates (the actor sits out the first ``trainer.critic_warmup``)."""
    return max(cfg.trainer.total_steps - (cfg.trainer.critic_warmup if role == "actor" else 0), 0)


def engine_view(cfg: TrainConfig, role: str) -> ActorConfig | CriticConfig:
    """The engine's config of ``role`` (``actor``/``critic``): the section's settings with ``ppo_mini_batch_size``
    in sequences (prompts x ``rollout.n``), ``loss_scale_factor`` resolved (C; the maximum response length unless
    given), the optimizer steps of one training step (the learning-rate schedule's unit), and a cosine decay
    without ``optim.decay_steps`` spread over the role's training steps after warm-up, reaching its floor on the
    last one. Micro-batch sizes (sequences per batch shard), token budgets, epochs and normalization count alike on both
    sides and are passed on as they are."""
    section = getattr(cfg, role)
    engine_config = ENGINE_CONFIGS[role]
    derived = {"ppo_mini_batch_size", "loss_scale_factor", "optim", "optimizer_steps_per_training_step"}
    same = {f.name: getattr(section, f.name) for f in dataclasses.fields(engine_config) if f.name not in derived}
    optim = section.optim
    if optim.lr_schedule == "cosine" and optim.decay_steps == 0:
        # warm-up takes training steps 0 .. W-1; the cosine runs from step W to its floor at the last step
        optim = dataclasses.replace(optim, decay_steps=max(training_steps(cfg, role) - optim.warmup_steps - 1, 1))
    return engine_config(
        **same,
        ppo_mini_batch_size=section.ppo_mini_batch_size * cfg.rollout.n,
        loss_scale_factor=float(section.loss_scale_factor or cfg.rollout.max_response_length),
        optimizer_steps_per_training_step=optimizer_steps_per_training_step(cfg, role),
        optim=optim,
    )

