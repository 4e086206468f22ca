"""The off-policy schedule and its weight queue (``jppo.run.offpolicy``); whole runs with ``trainer.off_policy_steps``
(mesh independence, resume after a failure mid-step) are in ``test_whole_run.py``."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jppo.run.offpolicy import behaviour_updates, copied, initial_behind, pushed, staleness


def test_the_schedule_is_on_policy_at_k0_and_bounded_by_k():
    assert [behaviour_updates(t, 0) for t in range(1, 6)] == [0, 1, 2, 3, 4]
    assert [behaviour_updates(t, 1) for t in range(1, 6)] == [0, 0, 1, 2, 3]
    assert [behaviour_updates(t, 3) for t in range(1, 7)] == [0, 0, 0, 0, 1, 2]
    assert [staleness(t, 0) for t in range(1, 6)] == [0] * 5
    assert [staleness(t, 2) for t in range(1, 7)] == [0, 1, 2, 2, 2, 2]


@pytest.mark.parametrize("k", [1, 2, 4])
def test_the_queue_holds_the_weights_each_upcoming_batch_is_sampled_with(k):
    """Weights stand for the number of updates they have had. Before step t the queue's head samples batch t, and
    the next batch (started before step t's update) is sampled by the head of the queue one update on."""
    behind, weights = (0,) * k, 0  # the queue of a fresh run: the initial weights k times
    for t in range(1, 12):
        assert len(behind) == k and behind[0] == behaviour_updates(t, k)
        assert list(behind) == [behaviour_updates(t + i, k) for i in range(k)]
        assert pushed(behind, weights)[0] == behaviour_updates(t + 1, k)  # exists before step t's update
        behind, weights = pushed(behind, weights), weights + 1  # step t's update


def test_the_initial_queue_is_one_copy_that_outlives_a_donating_update():
    """The update donates the parameters it is given (their buffers are reused); the queue's copy stays valid."""
    params = {"w": jnp.arange(4.0), "b": jnp.ones((2, 3))}
    assert initial_behind(params, 0) is None
    behind = initial_behind(params, 3)
    assert len(behind) == 3 and behind[0] is behind[1] is behind[2]

    @functools.partial(jax.jit, donate_argnums=(0,))
    def update(p):
        return jax.tree.map(lambda x: x + 1.0, p)

    kept = copied(params)
    params = update(params)
    for name in ("w", "b"):
        np.testing.assert_array_equal(kept[name], behind[0][name])  # both still readable, unchanged
        np.testing.assert_array_equal(params[name], np.asarray(kept[name]) + 1.0)
        assert kept[name].sharding == params[name].sharding
