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
from jppo.config.views import engine_view
from jppo.core.experience import Experience
from jppo.engine import UpdateStep, actor_loss_fn, critic_loss_fn, run_updates
from jppo.engine.config import ActorConfig, CriticConfig
from jppo.run.state import RunState, advance

# Each role's place in its mini-batch key, fixed for good (another number would change every run's batches). The
# actor's 0 adds nothing to the key: numpy's SeedSequence pads its entropy with zeros, so [seed, step, 0] draws what
# [seed, step] drew, and a run without a critic cuts its mini-batches as it always has.
SHUFFLE_STREAMS = {"actor": 0, "critic": 1, "sft": 0}  # sft: python -m jppo.sft's only model


def mini_batch_rng(seed: int, step: int, role: str) -> np.random.Generator:
    """The generator of ``role``'s mini-batch order in training step ``step`` (1-based): a function of the seed, the
    step and the role alone. Each role draws from its own key, so the actor's batches do not depend on whether a
    critic exists (nor, as for any draw of the update, on the mesh or the processes:
    docs/contract.md#runs-do-not-depend-on-the-hardware)."""
    return np.random.default_rng([seed, step, SHUFFLE_STREAMS[role]])


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
    each over its own mini-batch order (:func:`mini_batch_rng`: the seed, the step and the role; the actor's is the
    same with or without a critic); returns the state one step on."""
    cfg, metrics = learner.cfg, {}
    step = int(state.step) + 1
    critic, actor = state.critic, state.actor
    if learner.critic_step is not None:
        with timer("update_critic"):
            critic, critic_metrics, _ = run_updates(
                learner.critic_step, critic, experience, learner.critic_cfg, learner.mesh,
                mini_batch_rng(cfg.trainer.seed, step, "critic"),
            )
        metrics.update(critic_metrics)
    if step > cfg.trainer.critic_warmup:
        with timer("update_actor"):
            actor, actor_metrics, _ = run_updates(
                learner.actor_step, actor, experience, learner.actor_cfg, learner.mesh,
                mini_batch_rng(cfg.trainer.seed, step, "actor"),
            )
        metrics.update(actor_metrics)
    return advance(state, actor=actor, critic=critic, step=step), metrics
