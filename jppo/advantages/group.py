"""Outcome estimators that compare each response with the other responses to the same prompt.

Every function here starts from the same three facts about the batch:

- the score of row ``i`` is ``s_i = sum_t m_it r_it``, summed under the mask;
- row ``i`` belongs to the group of rows sharing its id ``index[i]``; rows without valid tokens belong to no group;
- a group of fewer than two rows has no peer to compare with, so its row's group-relative advantage is 0.

Groups are found with a ``[B, B]`` equality matrix of the ids, so ids can be any integers (not 0..G-1) and the
whole construction stays inside jit. Group sums are masked sums over that matrix rather than matmuls, which keeps
them exact on accelerators whose default matmul precision is reduced.

The per-row advantage is broadcast to the row's valid tokens; ``returns`` equals ``advantages``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jppo.advantages._common import check_row_arrays, check_token_arrays, safe_sqrt, sanitize
from jppo.advantages.masked import masked_whiten
from jppo.losses.aggregate import safe_divide

Array = jax.Array


class _Groups:
    """Scores, group membership and group statistics of one batch (an internal helper, built per call)."""

    def __init__(self, token_level_rewards: Array, mask: Array, index: Array) -> None:
        check_token_arrays(mask, token_level_rewards=token_level_rewards)
        check_row_arrays(mask, index=index)
        self.valid = mask.astype(bool)
        self.lengths = jnp.sum(self.valid, axis=-1, dtype=token_level_rewards.dtype)
        self.scores = jnp.sum(sanitize(token_level_rewards, self.valid), axis=-1)
        has_tokens = self.lengths > 0
        # same[i, j]: rows i and j are both non-empty and share a group id.
        self.same = (index[:, None] == index[None, :]) & has_tokens[:, None] & has_tokens[None, :]
        self.sizes = self.sum(jnp.ones_like(self.scores))
        self.has_peers = self.sizes > 1

    def sum(self, row_values: Array) -> Array:
        """``sum_{j in group(i)} v_j`` for every row ``i`` (0 for rows in no group)."""
        return jnp.sum(jnp.where(self.same, row_values[None, :], 0), axis=1)

    def mean(self, row_values: Array) -> Array:
        return safe_divide(self.sum(row_values), self.sizes)

    def std(self, row_values: Array) -> Array:
        """Unbiased standard deviation of the group (0 for groups of fewer than two rows)."""
        squared_deviation = jnp.square(row_values - self.mean(row_values))
        return safe_sqrt(safe_divide(self.sum(squared_deviation), jnp.maximum(self.sizes - 1, 0)))

    def to_tokens(self, row_advantages: Array) -> tuple[Array, Array]:
        """Applies the peer rule, broadcasts to the valid tokens and returns ``(advantages, returns)``."""
        row_advantages = jnp.where(self.has_peers, row_advantages, 0)
        advantages = sanitize(jnp.broadcast_to(row_advantages[:, None], self.valid.shape), self.valid)
        return advantages, advantages


def grpo(
    token_level_rewards: Array, mask: Array, index: Array, *, norm_by_std: bool = True, epsilon: float = 1e-6
) -> tuple[Array, Array]:
    """GRPO (Shao et al. 2024): ``A_i = (s_i - mean_g) / (std_g + epsilon)`` with the group's unbiased std.

    ``norm_by_std=False`` gives Dr. GRPO (Liu et al. 2025): ``A_i = s_i - mean_g``. A group whose scores are all
    equal gets 0. verl gives a group of one ``mean 0, std 1`` (advantage = raw score); jppo gives it 0.
    """
    groups = _Groups(token_level_rewards, mask, index)
    centered = groups.scores - groups.mean(groups.scores)
    if norm_by_std:
        centered = centered / (groups.std(groups.scores) + epsilon)
    return groups.to_tokens(centered)


def rloo(token_level_rewards: Array, mask: Array, index: Array) -> tuple[Array, Array]:
    """RLOO (Ahmadian et al. 2024): the score minus the mean score of the *other* rows of the group.

    ``A_i = s_i - (sum_g s - s_i) / (k - 1) = (k s_i - sum_g s) / (k - 1)`` for a group of ``k >= 2`` rows.
    Like verl's ``rloo_vectorized``; verl's ``rloo`` leaves the raw score for a group of one, jppo gives 0.
    """
    groups = _Groups(token_level_rewards, mask, index)
    others = jnp.maximum(groups.sizes - 1, 1)
    return groups.to_tokens((groups.sizes * groups.scores - groups.sum(groups.scores)) / others)


def reinforce_plus_plus_baseline(token_level_rewards: Array, mask: Array, index: Array) -> tuple[Array, Array]:
    """REINFORCE++-baseline (Hu 2025): group-centered scores, whitened over the batch's valid tokens.

    ``x_i = s_i - mean_g`` on every valid token of row ``i``, then ``A = whiten(x)`` over all valid tokens. A group
    of one is centered to 0 (like a group whose rows all tied) before the whitening, so after it that row holds
    the same value as any tied group's rows; verl centers it to its raw score.
    """
    groups = _Groups(token_level_rewards, mask, index)
    centered, _ = groups.to_tokens(groups.scores - groups.mean(groups.scores))
    advantages = masked_whiten(centered, groups.valid)
    return advantages, advantages


def opo(token_level_rewards: Array, mask: Array, index: Array) -> tuple[Array, Array]:
    """OPO (Hao et al. 2025): the score minus the group's length-weighted mean score.

    ``A_i = s_i - sum_g n_j s_j / sum_g n_j`` with ``n_j`` the valid tokens of row ``j``.
    """
    groups = _Groups(token_level_rewards, mask, index)
    baseline = safe_divide(groups.sum(groups.lengths * groups.scores), groups.sum(groups.lengths))
    return groups.to_tokens(groups.scores - baseline)


def gpg(token_level_rewards: Array, mask: Array, index: Array) -> tuple[Array, Array]:
    """GPG (Chu et al. 2025): ``A_i = alpha (s_i - mean_g)`` with ``alpha = B / max(M, 1)``.

    ``B`` is the number of non-empty rows of the batch and ``M`` the number of those with a non-zero score; alpha
    rescales a batch mean so that it acts as a mean over the rows that can carry a signal. verl counts every row
    in ``B`` and every non-zero (unmasked) sum in ``M``; the two agree when no row is empty.
    """
    groups = _Groups(token_level_rewards, mask, index)
    has_tokens = groups.lengths > 0
    num_rows = jnp.sum(has_tokens, dtype=groups.scores.dtype)
    num_scored = jnp.sum(has_tokens & (groups.scores != 0), dtype=groups.scores.dtype)
    alpha = num_rows / jnp.maximum(num_scored, 1)
    return groups.to_tokens(alpha * (groups.scores - groups.mean(groups.scores)))


def grpo_passk(
    token_level_rewards: Array, mask: Array, index: Array, *, norm_by_std: bool = True, epsilon: float = 1e-6
) -> tuple[Array, Array]:
    """Pass@k GRPO (Chen et al. 2025): only a group's best row gets a signal, its margin over the runner-up.

    ``A_i = max(s_i - max_{j in g, j != i} s_j, 0)``, divided by ``std_g + epsilon`` when ``norm_by_std``: the
    unique best row gets ``s_max - s_second``, every other row (and every row of a tie for the best) gets 0.
    verl raises for a group of one; jppo gives it 0.
    """
    groups = _Groups(token_level_rewards, mask, index)
    is_other_peer = groups.same & ~jnp.eye(groups.same.shape[0], dtype=bool)
    best_other = jnp.max(jnp.where(is_other_peer, groups.scores[None, :], -jnp.inf), axis=1)
    best_other = jnp.where(groups.has_peers, best_other, groups.scores)
    margin = jnp.maximum(groups.scores - best_other, 0)
    if norm_by_std:
        margin = margin / (groups.std(groups.scores) + epsilon)
    return groups.to_tokens(margin)
