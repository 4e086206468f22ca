"""The update engine: jitted actor/critic optimizer steps and forward passes over micro-batches.

Every loss in here is normalized by whole-mini-batch counts computed once (``psum`` over the batch axes), the
micro-batch gradients are summed by ``optax.MultiSteps(use_grad_mean=False)``, and metrics are reduced as
(numerator, denominator) pairs: the update does not depend on how its mini-batch was cut.
"""

from jppo.engine.config import ActorConfig, CriticConfig, OptimConfig, UpdateConfig
from jppo.engine.driver import Updated, check_batch_sizes, cut_steps, mini_batches, run_updates
from jppo.engine.forward import forward_batch, log_prob_fn, reward_model_fn, value_fn
from jppo.engine.update import (
    TrainState,
    UpdateStep,
    actor_loss_fn,
    critic_loss_fn,
    init_train_state,
    make_update_step,
    mini_batch_norm_stats,
)

__all__ = [
    "ActorConfig",
    "CriticConfig",
    "OptimConfig",
    "TrainState",
    "UpdateConfig",
    "UpdateStep",
    "Updated",
    "actor_loss_fn",
    "check_batch_sizes",
    "critic_loss_fn",
    "cut_steps",
    "forward_batch",
    "init_train_state",
    "log_prob_fn",
    "make_update_step",
    "mini_batch_norm_stats",
    "mini_batches",
    "reward_model_fn",
    "run_updates",
    "value_fn",
]
