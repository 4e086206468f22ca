"""Rewards onto tokens: where each response's scores, per-character credits and environment rewards go.

A row's reward is one number (the task's or plug-in's score, plus a reward model's, plus an environment's per-turn
rewards), but the advantage estimators read per-token rewards ``[N, L]``. :func:`place_rewards` puts an
environment's per-turn rewards on their turns' last tokens and the rest on the response's last model token
(:func:`last_token_scores`), or, with ``reward.token_level``, spreads a built-in task's per-character credit over
the tokens that earned it (:func:`token_credit_rewards`); every row still sums to its reward.
"""

from __future__ import annotations

import numpy as np

from jppo.core.experience import Experience


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
    response_attention: np.ndarray | None = None,
) -> np.ndarray:
    """Dense rewards ``[N, L]`` from per-character credits (plus one for the EOS of a finished response).

    Each response token gets the credit of the characters it decodes to (``decode`` of that token alone), a
    finished response's EOS token gets the EOS credit, and whatever part of the score the credits do not cover
    (a format bonus) goes on the last token, so every row still sums to its score. Characters are counted over
    ``response_attention`` (every response token, environment observations included, as the text was decoded),
    and credit is placed only where ``response_mask`` is set: a task must give observation characters none.
    """
    mask = response_mask.astype(bool)
    attention = mask if response_attention is None else response_attention.astype(bool)
    out = last_token_scores(scores - np.asarray([sum(c) for c in credits], np.float32), mask)
    for row, (ids, seen, valid, credit, done) in enumerate(zip(response_ids, attention, mask, credits, finished)):
        positions = np.flatnonzero(seen)
        if done and len(positions):
            out[row, positions[-1]] += credit[-1]
            positions = positions[:-1]
        char = 0
        for position in positions:
            width = len(decode([int(ids[position])]))
            if valid[position]:
                out[row, position] += sum(credit[char : char + width])
            char += width
    return out


def env_rewards(batch: Experience) -> np.ndarray:
    """The environment's per-token rewards of a multi-turn batch (zeros for a single-turn one)."""
    if batch.token_rewards is None:
        return np.zeros(batch.response_mask.shape, np.float32)
    return np.asarray(batch.token_rewards, np.float32)


def place_rewards(exp: Experience, scores: np.ndarray, finished: list[bool], credits, decode) -> np.ndarray:
    """Per-token rewards ``[N, L]`` of rows whose total reward is ``scores``: an environment's per-turn rewards
    stay on their turns' last tokens, and the rest of each row's reward goes on its last model token (or, with a
    task's per-character ``credits``, on the tokens that earned it, :func:`token_credit_rewards`)."""
    per_turn = env_rewards(exp)
    outcome = (np.asarray(scores, np.float32) - per_turn.sum(axis=1)).astype(np.float32)
    if credits is not None:
        rewards = token_credit_rewards(
            exp.response_ids, exp.response_mask, credits, finished, outcome, decode, exp.response_attention
        )
    else:
        rewards = last_token_scores(outcome, exp.response_mask)
    return rewards + per_turn
