"""KL coefficient controllers for KL-in-reward, as pure state updates (jittable, checkpointable).

- Fixed: the coefficient never changes.
- Adaptive (Ziegler et al. 2019): ``coef <- coef * (1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon)``,
  with ``kl`` the current mean KL and ``n_steps`` the samples seen since the last update.

A controller is a frozen configuration; its only state is :class:`KLControlState`, threaded through the training
loop: ``state = controller.update(state, current_kl, n_steps)``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from jppo.core.errors import InvalidSetting

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
