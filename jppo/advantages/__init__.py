"""Advantage estimators: pure, jittable functions of response-aligned ``[B, L]`` arrays.

Every estimator returns ``(advantages, returns)``, both ``[B, L]``. ``mask`` is the response mask; rewards,
values and baselines at masked positions (or of rows without valid tokens) are never read, so NaN/Inf there
reaches neither the results nor their gradients.

They run once over the WHOLE rollout batch, before it is cut into mini- and micro-batches, under jit with the
global (possibly sharded) arrays. Batch-wide statistics (the whitening of GAE and REINFORCE++, group means and
standard deviations, GPG's alpha) are therefore global by construction; no collective is needed.

Rules jppo applies to every estimator:

- **Masked positions hold 0** in both outputs.
- **Scores are summed under the mask**: ``s_i = sum_t m_it r_it``; a score written at a masked position does not
  count.
- **Rows without valid tokens belong to no group**: they are not sequences (as in :class:`~jppo.core.masked.NormStats`),
  get 0 and do not shift the mean, std or size of the group they were sampled in.
- **A group of fewer than two rows has no peer, so its group-relative advantage is 0**, for every group
  estimator (GRPO, Dr. GRPO, RLOO, REINFORCE++-baseline, OPO, GPG, pass@k). It is what the formulas give with the
  group's own mean as baseline. REINFORCE++-baseline then whitens that 0 with the rest of the batch, exactly as
  it does for a group whose rows all tied.
- **Group ids** (``group_ids``, one per row) are any integers (negative, large, not contiguous). Without x64 they
  are cast to int32, so ids must fit in it.
- Masked statistics divide exactly (:mod:`jppo.core.masked`); whitening uses ``epsilon = 1e-8`` and GRPO
  ``epsilon = 1e-6``.

How these rules differ from verl's estimators: ``tests/golden_verl/PARITY.md``.

Choose an estimator by name from :data:`ADVANTAGE_ESTIMATORS` and run it with :func:`run_estimator`; a new one is a
function decorated with ``@register_estimator(name)`` in the file that implements it.
"""

# Importing the estimators registers them, in this order: the token-level ones, then the group ones.
from jppo.advantages.estimate import run_estimator
from jppo.advantages.group import gpg, grpo, grpo_passk, opo, reinforce_plus_plus_baseline, rloo
from jppo.advantages.registry import ADVANTAGE_ESTIMATORS, Estimator, get_estimator, register_estimator
from jppo.advantages.returns import gae, reinforce_plus_plus, remax

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "Estimator",
    "gae",
    "get_estimator",
    "gpg",
    "grpo",
    "grpo_passk",
    "opo",
    "reinforce_plus_plus",
    "register_estimator",
    "reinforce_plus_plus_baseline",
    "remax",
    "rloo",
    "run_estimator",
]
