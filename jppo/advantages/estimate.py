"""The one way an estimator is run by name: inputs checked against what it takes, then called (jittable).

:func:`run_estimator` is the checked call (its exact keyword arguments); :func:`compute_advantages` is what
collection calls over the whole rollout batch: it passes each estimator only the inputs and options it takes, and
compiles once per estimator, options and shapes. Both stay pure functions of arrays: where this process's rows
go (the global row-sharded batch of a run's mesh) is the caller's ``place``, so this layer needs no mesh.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jppo.advantages.registry import get_estimator

Array = jax.Array

# (this process's arrays) -> (the arrays the estimator runs on, the function taking its results back)
Place = Callable[[list[np.ndarray]], tuple[list[Array], Callable[[Array], np.ndarray]]]


def run_estimator(name: str, **inputs: Any) -> tuple[Array, Array]:
    """Runs estimator ``name`` on ``inputs`` (its exact keyword arguments) and returns ``(advantages, returns)``.

    Raises ``ValueError`` for an unknown name, a missing input or an input the estimator does not take, naming it
    and listing what the estimator accepts: the checks run on names only, before anything is traced.
    """
    estimator = get_estimator(name)
    accepted = ", ".join(estimator.parameters)
    missing = [key for key in estimator.required if key not in inputs]
    if missing:
        raise ValueError(f"advantage estimator {name!r} is missing input(s) {', '.join(missing)}; it takes {accepted}")
    unexpected = sorted(set(inputs) - set(estimator.parameters))
    if unexpected:
        raise ValueError(f"advantage estimator {name!r} does not take {', '.join(unexpected)}; it takes {accepted}")
    return estimator.fn(**inputs)


@functools.partial(jax.jit, static_argnames=("name", "options"))
def _advantages(name, options, inputs):
    return run_estimator(name, **inputs, **dict(options))


def _as_given(arrays: list[np.ndarray]):
    return [jnp.asarray(a) for a in arrays], np.asarray


def compute_advantages(
    name: str,
    *,
    token_level_rewards: np.ndarray,
    response_mask: np.ndarray,
    values: np.ndarray | None = None,
    group_ids: np.ndarray | None = None,
    reward_baselines: np.ndarray | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    place: Optional[Place] = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Runs the registered estimator ``name`` with the inputs and options it takes (one compilation per shape).

    ``place`` (default: the arrays as given) takes the inputs to where the estimator runs. A run passes
    :func:`jppo.parallel.hostlocal.on_mesh` of its mesh: the inputs are this process's rows, the estimator runs on
    the global row-sharded batch, so its batch-wide statistics (whitening, group baselines) are those of the whole
    batch, and each process gets its own rows back. Groups must not straddle processes (rows of a prompt are
    adjacent, and processes hold whole prompts)."""
    estimator = get_estimator(name)
    available = {
        "token_level_rewards": token_level_rewards,
        "mask": response_mask,
        "values": values,
        "group_ids": group_ids,
        "reward_baselines": reward_baselines,
    }
    option_values = {"gamma": gamma, "lam": lam, "norm_by_std": norm_adv_by_std_in_grpo}
    names = [k for k, v in available.items() if k in estimator.parameters and v is not None]
    arrays, back = (place or _as_given)([available[k] for k in names])
    options = tuple(sorted((k, v) for k, v in option_values.items() if k in estimator.parameters))
    advantages, returns = _advantages(name, options, dict(zip(names, arrays)))
    return back(advantages), back(returns)
