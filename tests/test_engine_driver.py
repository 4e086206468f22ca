"""Host-side orchestration of updates: how a rollout batch becomes mini-batches."""

import numpy as np
import pytest

from jppo.engine import ActorConfig
from jppo.engine.driver import mini_batches


@pytest.mark.parametrize("shuffle", [True, False])
def test_mini_batches_cover_every_row_once_per_epoch_and_keep_rows_on_their_shard(shuffle):
    cfg = ActorConfig(ppo_mini_batch_size=8, ppo_epochs=3, shuffle=shuffle)
    steps = mini_batches(32, 4, cfg, np.random.default_rng(0))
    assert len(steps) == 3 * 4
    for epoch in range(3):
        rows = np.concatenate(steps[4 * epoch : 4 * epoch + 4])
        np.testing.assert_array_equal(np.sort(rows), np.arange(32))
    for rows in steps:
        # block d of a mini-batch (what shard d holds) comes from shard d's own rows [8 d, 8 d + 8)
        np.testing.assert_array_equal(rows.reshape(4, 2) // 8, np.repeat(np.arange(4), 2).reshape(4, 2))
    if not shuffle:
        np.testing.assert_array_equal(steps[0], [0, 1, 8, 9, 16, 17, 24, 25])


def test_shuffles_differ_between_epochs_and_repeat_for_the_same_seed():
    cfg = ActorConfig(ppo_mini_batch_size=8, ppo_epochs=2)
    first = mini_batches(32, 2, cfg, np.random.default_rng(5))
    again = mini_batches(32, 2, cfg, np.random.default_rng(5))
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not np.array_equal(np.concatenate(first[:4]), np.concatenate(first[4:]))
