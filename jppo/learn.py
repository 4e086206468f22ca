"""Learning from collected experience: ``ppo_epochs`` x mini-batches of critic, then actor, updates.

The engine does the work (:func:`jppo.engine.run_updates`: one compiled call per model, normalizers computed once
per mini-batch); this stage decides which models update this step and in which order, and advances the step.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jppo.config import TrainConfig
from jppo.engine import UpdateStep, actor_loss_fn, critic_loss_fn, run_updates
from jppo.engine.config import ActorConfig, CriticConfig
from jppo.experience import Experience
from jppo.state import RunState, advance
from jppo.views import engine_view


@dataclasses.dataclass(frozen=True)
class Learner:
    """The compiled update steps of the run's models and the engine's view of their config."""

    cfg: TrainConfig
    mesh: Mesh
    actor_cfg: ActorConfig
    actor_step: UpdateStep
    critic_cfg: Optional[CriticConfig]
    critic_step: Optional[UpdateStep]

    @classmethod
    def create(cls, cfg: TrainConfig, mesh: Mesh, policy: nnx.GraphDef, critic: Optional[nnx.GraphDef]) -> "Learner":
        actor_cfg = engine_view(cfg, "actor")
        actor_step = UpdateStep(policy, actor_loss_fn(actor_cfg, cfg.rollout.temperature), actor_cfg, mesh, "actor")
        critic_cfg = critic_step = None
        if critic is not None:
            critic_cfg = engine_view(cfg, "critic")
            critic_step = UpdateStep(critic, critic_loss_fn(critic_cfg), critic_cfg, mesh, "critic")
        return cls(cfg, mesh, actor_cfg, actor_step, critic_cfg, critic_step)


def learn(
    learner: Learner, state: RunState, experience: Experience, timer: Callable
) -> tuple[RunState, dict[str, float]]:
    """Step ``state.step + 1``'s updates: the critic's, then (after ``trainer.critic_warmup`` steps) the actor's,
    each over the same mini-batch order (drawn from the seed and the step); returns the state one step on."""
    cfg, metrics = learner.cfg, {}
    step = state.steps_done + 1
    update_rng = np.random.default_rng([cfg.trainer.seed, step])
    critic, actor = state.critic, state.actor
    if learner.critic_step is not None:
        with timer("update_critic"):
            critic, critic_metrics, _ = run_updates(
                learner.critic_step, critic, experience, learner.critic_cfg, learner.mesh, update_rng
            )
        metrics.update(critic_metrics)
    if step > cfg.trainer.critic_warmup:
        with timer("update_actor"):
            actor, actor_metrics, _ = run_updates(
                learner.actor_step, actor, experience, learner.actor_cfg, learner.mesh, update_rng
            )
        metrics.update(actor_metrics)
    return advance(state, actor=actor, critic=critic, step=step), metrics
