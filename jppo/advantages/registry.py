"""The advantage estimators by name, with what each needs from the rollout (run one with
:func:`jppo.advantages.estimate.run_estimator`).

Each estimator registers itself where it is written (:mod:`jppo.advantages.group`, :mod:`jppo.advantages.returns`)
with ``@register_estimator(name)``; importing :mod:`jppo.advantages` registers them all.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Callable

import jax

from jppo.core.registry import Registry

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Estimator:
    """An advantage estimator: ``fn(**inputs) -> (advantages, returns)``, both ``[B, L]``.

    What it needs is read off ``fn``'s signature, so the flags cannot drift from the function.
    """

    fn: Callable[..., tuple[Array, Array]]

    @property
    def parameters(self) -> tuple[str, ...]:
        """Every input and option name ``fn`` accepts."""
        return tuple(inspect.signature(self.fn).parameters)

    @property
    def required(self) -> tuple[str, ...]:
        """The names ``fn`` cannot be called without (arrays and options without defaults, e.g. ``gamma``)."""
        params = inspect.signature(self.fn).parameters.values()
        return tuple(p.name for p in params if p.default is inspect.Parameter.empty)

    @property
    def needs_critic(self) -> bool:
        return "values" in self.parameters

    @property
    def needs_group_ids(self) -> bool:
        return "group_ids" in self.parameters

    @property
    def needs_reward_baselines(self) -> bool:
        return "reward_baselines" in self.parameters


ADVANTAGE_ESTIMATORS: Registry[Estimator] = Registry(
    "advantage estimator",
    lambda name, names: f"unknown advantage estimator {name!r}; valid estimators: {', '.join(sorted(names))}",
)

EstimatorFn = Callable[..., tuple[Array, Array]]


def register_estimator(name: str) -> Callable[[EstimatorFn], EstimatorFn]:
    """Decorator registering an estimator function in :data:`ADVANTAGE_ESTIMATORS` under ``name`` (as an
    :class:`Estimator`, whose needs are read off the function's signature); the function is returned unchanged."""

    def register(fn: EstimatorFn) -> EstimatorFn:
        ADVANTAGE_ESTIMATORS.register(name)(Estimator(fn))
        return fn

    return register


def get_estimator(name: str) -> Estimator:
    """The registered estimator ``name``; raises ``ValueError`` listing the valid names otherwise."""
    return ADVANTAGE_ESTIMATORS.lookup(name)
