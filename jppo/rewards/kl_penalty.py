"""KL in the reward: the penalty on the rewards, and the controllers of its coefficient.

:func:`kl_in_reward` subtracts ``kl_coef * KL(old || ref)`` per token from the rewards (``algorithm.use_kl_in_reward``)
and measures the whole batch's mean per-sequence KL, which a controller then reads. The controllers are pure state
updates (jittable, checkpointable):

- Fixed: the coefficient never changes.
- Adaptive (Ziegler et al. 2019): ``coef <- coef * (1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon)``,
  with ``kl`` the current mean KL and ``n_steps`` the samples seen since the last update.

A controller is a frozen configuration; its only state is :class:`KLControlState`, threaded through the training
loop: ``state = controller.update(state, current_kl, n_steps)``.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh

from jppo.core.errors import InvalidSetting
from jppo.losses import penalize_rewards
from jppo.parallel.hostlocal import on_mesh, replicated_value

Array = jax.Array

# The proportional error is clipped to +-20% per update (the original controller's bound).
_MAX_PROPORTIONAL_ERROR = 0.2


@struct.dataclass
class KLControlState:
    """The current KL coefficient (a scalar array)."""

    coef: Array


@dataclasses.dataclass(frozen=True)
class FixedKLController:
    """A constant coefficient ``kl_coef``."""

    kl_coef: float

    def init(self) -> KLControlState:
        return KLControlState(coef=jnp.asarray(self.kl_coef))

    def update(self, state: KLControlState, current_kl: float | Array, n_steps: int | Array) -> KLControlState:
        """Returns ``state`` unchanged (same signature as the adaptive controller)."""
        return state


@dataclasses.dataclass(frozen=True)
class AdaptiveKLController:
    """Moves the coefficient so that the observed KL approaches ``target_kl`` over ``horizon`` samples."""

    init_kl_coef: float
    target_kl: float
    horizon: float

    def __post_init__(self) -> None:
        for name in ("horizon", "target_kl"):
            if not getattr(self, name) > 0:
                raise InvalidSetting("AdaptiveKLController.", name, getattr(self, name), "> 0")

    def init(self) -> KLControlState:
        return KLControlState(coef=jnp.asarray(self.init_kl_coef))

    def update(self, state: KLControlState, current_kl: float | Array, n_steps: int | Array) -> KLControlState:
        """The coefficient after observing mean KL ``current_kl`` over ``n_steps`` samples (keeps its dtype)."""
        error = jnp.clip(current_kl / self.target_kl - 1, -_MAX_PROPORTIONAL_ERROR, _MAX_PROPORTIONAL_ERROR)
        coef = state.coef * (1 + error * n_steps / self.horizon)
        return KLControlState(coef=coef.astype(state.coef.dtype))


@functools.partial(jax.jit, static_argnames=("kind",))
def _kl_in_reward(scores, old_log_prob, ref_log_prob, mask, kl_coef, kind):
    rewards, kl = penalize_rewards(scores, old_log_prob, ref_log_prob, mask, kl_coef=kl_coef, kind=kind)
    mask = mask.astype(bool)
    tokens = jnp.maximum(jnp.sum(mask, axis=-1), 1)
    per_sequence = jnp.sum(jnp.where(mask, kl, 0.0), axis=-1) / tokens
    current_kl = jnp.sum(jnp.where(mask.any(-1), per_sequence, 0.0)) / jnp.maximum(jnp.sum(mask.any(-1)), 1)
    return rewards, current_kl


def kl_in_reward(
    scores, old_log_prob, ref_log_prob, mask, *, kl_coef: float, kind: str, mesh: Mesh | None = None
) -> tuple[np.ndarray, float]:
    """``scores - kl_coef * KL(old || ref)`` per token, and the whole batch's mean per-sequence KL (the controller's
    input). With a ``mesh`` the arrays are this process's rows of the batch."""
    arrays, back = on_mesh([scores, old_log_prob, ref_log_prob, mask], mesh)
    rewards, current_kl = _kl_in_reward(*arrays, jnp.float32(kl_coef), kind)
    return back(rewards), float(replicated_value(current_kl))
