"""The update engine: jitted actor/critic optimizer steps and forward passes over micro-batches.

Every loss in here is normalized by whole-mini-batch counts computed once (``psum`` over the batch axes), the
micro-batch gradients are summed by ``optax.MultiSteps(use_grad_mean=False)``, and metrics are reduced as
(numerator, denominator) pairs: the update does not depend on how its mini-batch was cut.

Each name loads from its submodule when first asked for (:func:`jppo.core.lazy.lazy_exports`): the config schema
composes :mod:`jppo.engine.config`'s fields without loading the jitted programs.
"""

from jppo.core.lazy import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "config": ("ActorConfig", "CriticConfig", "UpdateConfig"),
    "driver": ("Updated", "check_batch_sizes", "mini_batches", "run_updates", "step_micro_batches"),
    "forward": ("forward_batch", "log_prob_fn", "reward_model_fn", "value_fn"),
    "objectives": ("actor_loss_fn", "critic_loss_fn", "sft_loss_fn"),
    "state": ("TrainState", "abstract_train_state", "init_train_state"),
    "update": ("UpdateStep", "make_update_step", "mini_batch_norm_stats"),
})
