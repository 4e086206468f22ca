"""Advantage estimators: pure, jittable functions of response-aligned ``[B, L]`` arrays.

Every estimator returns ``(advantages, returns)``, both ``[B, L]``. ``mask`` is the response mask; rewards,
values and baselines at masked positions (or of rows without valid tokens) are never read, so NaN/Inf there
reaches neither the results nor their gradients.

They run once over the WHOLE rollout batch, before it is cut into mini- and micro-batches, under jit with the
global (possibly sharded) arrays. Batch-wide statistics (the whitening of GAE and REINFORCE++, group means and
standard deviations, GPG's alpha) are therefore global by construction; no collective is needed.

Rules jppo applies to every estimator, and where they differ from verl (``verl/trainer/ppo/core_algos.py``):

- **Masked positions hold 0** in both outputs. verl leaves values there for GAE (whitened carried state, ``A+V``)
  and ReMax (reward-to-go in interior holes); only valid positions are comparable.
- **Scores are summed under the mask**: ``s_i = sum_t m_it r_it``. verl sums the whole row, so a score written
  at a masked position (verl reward managers put an empty response's score at index -1) still counts there.
- **Rows without valid tokens belong to no group**: they are not sequences (as in ``jppo.losses``' ``NormStats``),
  get 0 and do not shift the mean, std or size of the group they were sampled in.
- **A group of fewer than two rows has no peer, so its group-relative advantage is 0**, for every group
  estimator (GRPO, Dr. GRPO, RLOO, REINFORCE++-baseline, OPO, GPG, pass@k). It is what the formulas give with the
  group's own mean as baseline. REINFORCE++-baseline then whitens that 0 with the rest of the batch, exactly as
  it does for a group whose rows all tied. verl is inconsistent here: GRPO, GPG, OPO, RLOO and
  REINFORCE++-baseline use baseline 0 (the advantage is the raw score), ``rloo_vectorized`` gives 0, and pass@k
  raises.
- **Group ids** are any integers (negative, large, not contiguous). Without x64 they are cast to int32, so ids
  must fit in it.
- Masked statistics divide exactly (verl adds 1e-8 to the token count); whitening keeps verl's ``1e-8`` and GRPO
  its ``epsilon = 1e-6``.

Choose an estimator by name from :data:`ADVANTAGE_ESTIMATORS` and run it with :func:`compute_advantages`.
"""

from jppo.advantages.group import gpg, grpo, grpo_passk, opo, reinforce_plus_plus_baseline, rloo
from jppo.advantages.masked import masked_mean, masked_var, masked_whiten
from jppo.advantages.registry import ADVANTAGE_ESTIMATORS, Estimator, compute_advantages, get_estimator
from jppo.advantages.returns import gae, reinforce_plus_plus, remax

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "Estimator",
    "compute_advantages",
    "gae",
    "get_estimator",
    "gpg",
    "grpo",
    "grpo_passk",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "opo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "rloo",
]
