"""Outcome estimators that compare each response with the other responses to the same prompt.

Every function here starts from the same three facts about the batch:

- the score of row ``i`` is ``s_i = sum_t m_it r_it``, summed under the mask;
- row ``i`` belongs to the group of rows sharing its id ``group_ids[i]``; rows without valid tokens belong to no group;
- a group of fewer than two rows has no peer to compare with, so its row's group-relative advantage is 0.

Groups are found by sorting the rows by id (non-empty rows first, stable), so ids can be any integers (not
0..G-1) and the whole construction stays inside jit with ``O(B log B)`` work and ``O(B)`` memory; a ``[B, B]``
comparison of the ids would need a gigabyte per temporary at 16k rows. In sorted order a group is a run of
adjacent rows, and a group statistic is a segmented scan over the runs (restarting at each run's first row),
read at each run's last row and sent back to the rows. The scan combines a group's values in a fixed order that
depends only on the group's size, so results are reproducible on every backend: a scatter-add
(``jax.ops.segment_sum``) accumulates in an unspecified order on GPUs, and a matmul against a one-hot matrix is
inexact where the default matmul precision is reduced.

The per-row advantage is broadcast to the row's valid tokens; ``returns`` equals ``advantages``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jppo.advantages.registry import register_estimator
from jppo.core.masked import check_row_arrays, check_token_arrays, masked_whiten, safe_divide, safe_sqrt, sanitize

Array = jax.Array


def _segmented_scan(starts: Array, values: Array, combine, identity: float) -> Array:
    """Inclusive scan restarting at every ``starts[k]``: ``out_k = combine(v_s, ..., v_k)``, ``s`` the last start <= k.

    Hillis-Steele doubling in ``ceil(log2 B)`` levels of ``O(B)`` elementwise work. After level ``i`` (shift
    ``d = 2^i``), ``acc_k`` combines the values of ``[max(s, k - 2d + 1), k]`` and ``reached_k`` says whether that
    window already holds ``s``; a row whose window has not reached its start combines ``acc_{k-d}``, which covers
    the ``d`` rows before its own window (both lie in one group, as no start lies in between). The additions a
    group's total goes through depend only on the group's length, not on where it sits in the batch.
    """
    num_rows = values.shape[0]

    def shifted(array: Array, shift: Array, fill) -> Array:
        """``array`` moved ``shift`` rows down, ``fill`` in the rows it leaves (one compiled level for every shift)."""
        padded = jnp.concatenate([jnp.full_like(array, fill), array])
        return jax.lax.dynamic_slice_in_dim(padded, num_rows - shift, num_rows)

    def level(index: Array, carry: tuple[Array, Array]) -> tuple[Array, Array]:
        reached, acc = carry
        shift = jnp.left_shift(1, index)
        acc = jnp.where(reached, acc, combine(shifted(acc, shift, identity), acc))
        return reached | shifted(reached, shift, True), acc

    levels = (num_rows - 1).bit_length() if num_rows else 0
    return jax.lax.fori_loop(0, levels, level, (starts, values))[1]


class _Groups:
    """Scores, group membership and group statistics of one batch (an internal helper, built per call)."""

    def __init__(self, token_level_rewards: Array, mask: Array, group_ids: Array) -> None:
        check_token_arrays(mask, token_level_rewards=token_level_rewards)
        check_row_arrays(mask, group_ids=group_ids)
        self.valid = mask.astype(bool)
        self.lengths = jnp.sum(self.valid, axis=-1, dtype=token_level_rewards.dtype)
        self.scores = jnp.sum(sanitize(token_level_rewards, self.valid), axis=-1)
        self.has_tokens = self.lengths > 0
        num_rows = group_ids.shape[0]
        positions = jnp.arange(num_rows)
        # Sorted by id, non-empty rows first (lexsort's last key is the primary one): each group is one run.
        self.order = jnp.lexsort((group_ids, ~self.has_tokens))
        sorted_ids, sorted_has_tokens = group_ids[self.order], self.has_tokens[self.order]
        # A run starts at the first row, at a change of id, and at every empty row (each is a run of its own).
        changes = (sorted_ids[1:] != sorted_ids[:-1]) | ~sorted_has_tokens[1:]
        self.starts = jnp.concatenate([jnp.ones((1,), bool), changes])
        # run_end[k]: the last sorted position of k's run, where the inclusive scan holds the run's total.
        is_end = jnp.concatenate([changes, jnp.ones((1,), bool)])
        self.run_end = jax.lax.cummin(jnp.where(is_end, positions, num_rows), reverse=True)
        self.inverse = jnp.zeros_like(self.order).at[self.order].set(positions)
        self.sizes = self.sum(jnp.ones_like(self.scores))
        self.has_peers = self.sizes > 1

    def _reduce(self, row_values: Array, combine, identity: float) -> Array:
        """``combine`` over the run of every row, in sorted order, returned in row order."""
        scanned = _segmented_scan(self.starts, row_values[self.order], combine, identity)
        return scanned[self.run_end][self.inverse]

    def sum(self, row_values: Array) -> Array:
        """``sum_{j in group(i)} v_j`` for every row ``i`` (0 for rows in no group)."""
        return self._reduce(jnp.where(self.has_tokens, row_values, 0), jnp.add, 0.0)

    def max(self, row_values: Array) -> Array:
        """``max_{j in group(i)} v_j`` for every row ``i`` (``-inf`` for rows in no group)."""
        return self._reduce(jnp.where(self.has_tokens, row_values, -jnp.inf), jnp.maximum, -jnp.inf)

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


@register_estimator("grpo")
def grpo(
    token_level_rewards: Array, mask: Array, group_ids: Array, *, norm_by_std: bool = True, epsilon: float = 1e-6
) -> tuple[Array, Array]:
    """GRPO (Shao et al. 2024): ``A_i = (s_i - mean_g) / (std_g + epsilon)`` with the group's unbiased std.

    ``norm_by_std=False`` gives Dr. GRPO (Liu et al. 2025): ``A_i = s_i - mean_g``. A group whose scores are all
    equal gets 0, and so does a group of one.
    """
    groups = _Groups(token_level_rewards, mask, group_ids)
    centered = groups.scores - groups.mean(groups.scores)
    if norm_by_std:
        centered = centered / (groups.std(groups.scores) + epsilon)
    return groups.to_tokens(centered)


@register_estimator("rloo")
def rloo(token_level_rewards: Array, mask: Array, group_ids: Array) -> tuple[Array, Array]:
    """RLOO (Ahmadian et al. 2024): the score minus the mean score of the *other* rows of the group.

    ``A_i = s_i - (sum_g s - s_i) / (k - 1) = (k s_i - sum_g s) / (k - 1)`` for a group of ``k >= 2`` rows; 0 for
    a group of one.
    """
    groups = _Groups(token_level_rewards, mask, group_ids)
    others = jnp.maximum(groups.sizes - 1, 1)
    return groups.to_tokens((groups.sizes * groups.scores - groups.sum(groups.scores)) / others)


@register_estimator("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline(token_level_rewards: Array, mask: Array, group_ids: Array) -> tuple[Array, Array]:
    """REINFORCE++-baseline (Hu 2025): group-centered scores, whitened over the batch's valid tokens.

    ``x_i = s_i - mean_g`` on every valid token of row ``i``, then ``A = whiten(x)`` over all valid tokens. A group
    of one is centered to 0 (like a group whose rows all tied) before the whitening, so after it that row holds
    the same value as any tied group's rows.
    """
    groups = _Groups(token_level_rewards, mask, group_ids)
    centered, _ = groups.to_tokens(groups.scores - groups.mean(groups.scores))
    advantages = masked_whiten(centered, groups.valid)
    return advantages, advantages


@register_estimator("opo")
def opo(token_level_rewards: Array, mask: Array, group_ids: Array) -> tuple[Array, Array]:
    """OPO (Hao et al. 2025): the score minus the group's length-weighted mean score.

    ``A_i = s_i - sum_g n_j s_j / sum_g n_j`` with ``n_j`` the valid tokens of row ``j``.
    """
    groups = _Groups(token_level_rewards, mask, group_ids)
    baseline = safe_divide(groups.sum(groups.lengths * groups.scores), groups.sum(groups.lengths))
    return groups.to_tokens(groups.scores - baseline)


@register_estimator("gpg")
def gpg(token_level_rewards: Array, mask: Array, group_ids: Array) -> tuple[Array, Array]:
    """GPG (Chu et al. 2025): ``A_i = alpha (s_i - mean_g)`` with ``alpha = B / max(M, 1)``.

    ``B`` is the number of non-empty rows of the batch and ``M`` the number of those with a non-zero (masked)
    score; alpha rescales a batch mean so that it acts as a mean over the rows that can carry a signal.
    """
    groups = _Groups(token_level_rewards, mask, group_ids)
    has_tokens = groups.lengths > 0
    num_rows = jnp.sum(has_tokens, dtype=groups.scores.dtype)
    num_scored = jnp.sum(has_tokens & (groups.scores != 0), dtype=groups.scores.dtype)
    alpha = num_rows / jnp.maximum(num_scored, 1)
    return groups.to_tokens(alpha * (groups.scores - groups.mean(groups.scores)))


@register_estimator("grpo_passk")
def grpo_passk(
    token_level_rewards: Array, mask: Array, group_ids: Array, *, norm_by_std: bool = True, epsilon: float = 1e-6
) -> tuple[Array, Array]:
    """Pass@k GRPO (Chen et al. 2025): only a group's best row gets a signal, its margin over the runner-up.

    ``A_i = max(s_i - max_{j in g, j != i} s_j, 0)``, divided by ``std_g + epsilon`` when ``norm_by_std``: the
    unique best row gets ``s_max - s_second``, every other row (and every row of a tie for the best) gets 0, and
    so does a group of one.
    """
    groups = _Groups(token_level_rewards, mask, group_ids)
    # The best other row is the group's best, except for a unique best row, whose best other is the runner-up.
    best = groups.max(groups.scores)
    is_best = groups.scores == best
    unique_best = is_best & (groups.sum(is_best.astype(groups.scores.dtype)) == 1)
    runner_up = groups.max(jnp.where(is_best, -jnp.inf, groups.scores))
    best_other = jnp.where(unique_best, runner_up, best)
    best_other = jnp.where(groups.has_peers, best_other, groups.scores)
    margin = jnp.maximum(groups.scores - best_other, 0)
    if norm_by_std:
        margin = margin / (groups.std(groups.scores) + epsilon)
    return groups.to_tokens(margin)
