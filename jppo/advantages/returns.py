"""Token-level estimators built on reverse recursions over the response: GAE, REINFORCE++ and ReMax.

The recursions run over valid positions only. A masked position (padding after the response, or an observation
span inside a multi-turn response) is skipped: the recursion state is carried through it unchanged, so the value
and the advantage of the next valid token reach the previous valid token as if the span were absent. Rewards and
values at masked positions are never read.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jppo.advantages.registry import register_estimator
from jppo.core.masked import check_row_arrays, check_token_arrays, masked_whiten, sanitize

Array = jax.Array


def _masked_gae(rewards: Array, values: Array, valid: Array, gamma: Array, lam: Array) -> Array:
    """Raw GAE ``A_t = delta_t + gamma lam A_next``, ``delta_t = r_t + gamma V_next - V_t``, over valid positions.

    ``V_next`` and ``A_next`` belong to the next *valid* position (0 after the last one). At masked positions the
    output is the carried ``A_next``; callers zero it.
    """

    def step(carry: tuple[Array, Array], column: tuple[Array, Array, Array]) -> tuple[tuple[Array, Array], Array]:
        next_value, next_advantage = carry
        reward, value, is_valid = column
        advantage = reward + gamma * next_value - value + gamma * lam * next_advantage
        next_value = jnp.where(is_valid, value, next_value)
        next_advantage = jnp.where(is_valid, advantage, next_advantage)
        return (next_value, next_advantage), next_advantage

    zeros = jnp.zeros(rewards.shape[:1], rewards.dtype)
    _, advantages = jax.lax.scan(step, (zeros, zeros), (rewards.T, values.T, valid.T), reverse=True)
    return advantages.T


@register_estimator("gae")
def gae(
    token_level_rewards: Array,
    values: Array,
    mask: Array,
    *,
    gamma: float | Array,
    lam: float | Array,
    whiten: bool = True,
) -> tuple[Array, Array]:
    """Generalized Advantage Estimation (Schulman et al. 2016) with a critic's ``values``.

    Over the valid positions of each row, from the last to the first::

        delta_t = r_t + gamma * V_next - V_t
        A_t     = delta_t + gamma * lam * A_next
        R_t     = A_t + V_t

    where ``next`` is the next valid position of the row (``V_next = A_next = 0`` after the last one). The
    advantages are then whitened over all valid tokens of the batch (``whiten=True``); the returns are not.

    Args:
        token_level_rewards: ``[B, L]`` per-token rewards (outcome score, KL penalty, ...).
        values: ``[B, L]`` critic values at rollout time.
        mask: ``[B, L]`` response mask.
        gamma: discount factor.
        lam: GAE lambda.
        whiten: standardize the advantages over the batch's valid tokens.

    Returns:
        ``(advantages, returns)``, both ``[B, L]`` and exactly 0 at masked positions.
    """
    check_token_arrays(mask, token_level_rewards=token_level_rewards, values=values)
    valid = mask.astype(bool)
    dtype = token_level_rewards.dtype
    rewards = sanitize(token_level_rewards, valid)
    values = sanitize(values, valid)
    raw = _masked_gae(rewards, values, valid, jnp.asarray(gamma, dtype), jnp.asarray(lam, dtype))
    returns = sanitize(raw + values, valid)
    advantages = masked_whiten(raw, valid) if whiten else sanitize(raw, valid)
    return advantages, returns


@register_estimator("reinforce_plus_plus")
def reinforce_plus_plus(token_level_rewards: Array, mask: Array, *, gamma: float | Array) -> tuple[Array, Array]:
    """REINFORCE++ (Hu 2025): discounted returns, whitened over the batch's valid tokens.

    ``R_t = r_t + gamma * R_next`` over valid positions (``R_next`` of the next valid position, 0 after the last),
    ``A = whiten(R)``. This is :func:`gae` with zero values and ``lam = 1``.

    Returns:
        ``(advantages, returns)``, ``[B, L]``, 0 at masked positions.
    """
    check_token_arrays(mask, token_level_rewards=token_level_rewards)
    valid = mask.astype(bool)
    dtype = token_level_rewards.dtype
    rewards = sanitize(token_level_rewards, valid)
    discounted = _masked_gae(rewards, jnp.zeros_like(rewards), valid, jnp.asarray(gamma, dtype), jnp.ones((), dtype))
    returns = sanitize(discounted, valid)
    return masked_whiten(returns, valid), returns


@register_estimator("remax")
def remax(token_level_rewards: Array, reward_baselines: Array, mask: Array) -> tuple[Array, Array]:
    """ReMax (Li et al. 2023): undiscounted reward-to-go minus the reward of the greedy response.

    ``R_t = sum_{t' >= t} m_t' r_t'``, ``A_t = R_t - b`` with ``b`` the row's baseline (the score of its greedy
    decoding). No whitening.

    Args:
        token_level_rewards: ``[B, L]`` per-token rewards.
        reward_baselines: ``[B]`` baseline score per row.
        mask: ``[B, L]`` response mask.

    Returns:
        ``(advantages, returns)``, ``[B, L]``, 0 at masked positions (interior holes included).
    """
    check_token_arrays(mask, token_level_rewards=token_level_rewards)
    check_row_arrays(mask, reward_baselines=reward_baselines)
    valid = mask.astype(bool)
    returns = sanitize(jax.lax.cumsum(sanitize(token_level_rewards, valid), axis=1, reverse=True), valid)
    return sanitize(returns - reward_baselines[:, None], valid), returns
