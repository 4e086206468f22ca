"""The advantage estimators by name, with what each needs from the rollout (run one with
:func:`jppo.advantages.estimate.run_estimator`)."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Callable

import jax

from jppo.advantages import group, returns

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


ADVANTAGE_ESTIMATORS: dict[str, Estimator] = {
    "gae": Estimator(returns.gae),
    "reinforce_plus_plus": Estimator(returns.reinforce_plus_plus),
    "remax": Estimator(returns.remax),
    "grpo": Estimator(group.grpo),
    "rloo": Estimator(group.rloo),
    "reinforce_plus_plus_baseline": Estimator(group.reinforce_plus_plus_baseline),
    "opo": Estimator(group.opo),
    "gpg": Estimator(group.gpg),
    "grpo_passk": Estimator(group.grpo_passk),
}


def get_estimator(name: str) -> Estimator:
    """The registered estimator ``name``; raises ``ValueError`` listing the valid names otherwise."""
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"unknown advantage estimator {name!r}; valid estimators: {', '.join(sorted(ADVANTAGE_ESTIMATORS))}"
        )
    return ADVANTAGE_ESTIMATORS[name]
