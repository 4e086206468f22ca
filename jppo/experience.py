"""From sampled responses to a training batch: rewards, token-level scores, KL in the reward, advantages.

Everything here runs once per training step over the WHOLE rollout batch (``B * n`` sequences, rows
prompt-major), before the engine cuts it into mini- and micro-batches, so batch-wide statistics (advantage
whitening, group baselines, the KL controller's measurement) are global by construction.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jppo.advantages import get_estimator
from jppo.hostlocal import local_rows, local_shards, replicated_value, to_global, to_local
from jppo.losses import penalize_rewards
from jppo.mesh import batch_shards
from jppo.microbatch import SequenceBatch


def last_token_scores(scores: np.ndarray, response_mask: np.ndarray) -> np.ndarray:
    """Outcome rewards ``[N]`` placed on each response's last valid token ``[N, L]`` (nowhere for empty ones)."""
    mask = response_mask.astype(bool)
    length = mask.shape[1]
    last = length - 1 - np.argmax(mask[:, ::-1], axis=1)
    out = np.zeros(mask.shape, np.float32)
    rows = np.flatnonzero(mask.any(axis=1))
    out[rows, last[rows]] = scores[rows]
    return out


def token_credit_rewards(
    response_ids: np.ndarray,
    response_mask: np.ndarray,
    credits: list[list[float]],
    finished: list[bool],
    scores: np.ndarray,
    decode,
) -> np.ndarray:
    """Dense rewards ``[N, L]`` from per-character credits (plus one for the EOS of a finished response).

    Each response token gets the credit of the characters it decodes to (``decode`` of that token alone), a
    finished response's EOS token gets the EOS credit, and whatever part of the score the credits do not cover
    (a format bonus) goes on the last token, so every row still sums to its score.
    """
    mask = response_mask.astype(bool)
    out = last_token_scores(scores - np.asarray([sum(c) for c in credits], np.float32), mask)
    for row, (ids, valid, credit, done) in enumerate(zip(response_ids, mask, credits, finished)):
        positions = np.flatnonzero(valid)
        if done and len(positions):
            out[row, positions[-1]] += credit[-1]
            positions = positions[:-1]
        char = 0
        for position in positions:
            width = len(decode([int(ids[position])]))
            out[row, position] += sum(credit[char : char + width])
            char += width
    return out


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
    arrays, back = _on_mesh([scores, old_log_prob, ref_log_prob, mask], mesh)
    rewards, current_kl = _kl_in_reward(*arrays, jnp.float32(kl_coef), kind)
    return back(rewards), float(replicated_value(current_kl))


def _on_mesh(arrays: list[np.ndarray], mesh: Mesh | None):
    """The global row-sharded arrays of this process's rows, and the function taking results back to its rows."""
    if mesh is None:
        return [jnp.asarray(a) for a in arrays], np.asarray
    rows = local_rows(mesh, len(arrays[0]) * batch_shards(mesh) // len(local_shards(mesh)))
    return [to_global(np.asarray(a), mesh) for a in arrays], lambda x: to_local(x, rows=rows)


@functools.partial(jax.jit, static_argnames=("name", "options"))
def _advantages(name, options, inputs):
    estimator = get_estimator(name)
    return estimator.fn(**inputs, **dict(options))


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
    mesh: Mesh | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Runs the registered estimator ``name`` with the inputs and options it takes (one compilation per shape).

    With a ``mesh`` the inputs are this process's rows: the estimator runs on the global row-sharded batch, so
    its batch-wide statistics (whitening, group baselines) are those of the whole batch, and each process gets
    its own rows back. Groups must not straddle processes (rows of a prompt are adjacent, and processes hold
    whole prompts)."""
    estimator = get_estimator(name)
    available = {
        "token_level_rewards": token_level_rewards,
        "mask": response_mask,
        "values": values,
        "index": group_ids,
        "reward_baselines": reward_baselines,
    }
    option_values = {"gamma": gamma, "lam": lam, "norm_by_std": norm_adv_by_std_in_grpo}
    names = [k for k, v in available.items() if k in estimator.parameters and v is not None]
    arrays, back = _on_mesh([available[k] for k in names], mesh)
    options = tuple(sorted((k, v) for k, v in option_values.items() if k in estimator.parameters))
    advantages, returns = _advantages(name, options, dict(zip(names, arrays)))
    return back(advantages), back(returns)


def with_per_token(batch: SequenceBatch, **arrays: np.ndarray) -> SequenceBatch:
    """The same batch with more response-aligned arrays carried into the losses."""
    per_token = dict(batch.per_token)
    per_token.update({k: np.asarray(v, np.float32) for k, v in arrays.items()})
    return SequenceBatch(
        batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask, batch.response_attention, per_token
    )
