"""Host-side orchestration of updates: which rows share an optimizer step, and how they reach the shards.

The whole-run contract: the rows of every mini-batch of every epoch are a function of the seed and the config
alone, never of the mesh or the number of processes; each step's rows are dealt to the shards in equal blocks.
"""

import dataclasses

import jax
import numpy as np
import pytest

from jppo.core.experience import PER_TOKEN_FIELDS, Experience
from jppo.engine import ActorConfig
from jppo.engine.driver import mini_batches, regroup, shard_layout
from jppo.parallel.hostlocal import take_rows
from jppo.parallel.mesh import make_mesh


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("epochs,mini", [(1, 8), (3, 8), (2, 16), (2, 32)])
def test_mini_batches_cover_every_row_once_per_epoch(shuffle, epochs, mini):
    cfg = ActorConfig(ppo_mini_batch_size=mini, ppo_epochs=epochs, shuffle=shuffle)
    steps = mini_batches(32, cfg, np.random.default_rng(0))
    per_epoch = 32 // mini
    assert len(steps) == epochs * per_epoch and all(len(rows) == mini for rows in steps)
    for epoch in range(epochs):
        rows = np.concatenate(steps[per_epoch * epoch : per_epoch * (epoch + 1)])
        np.testing.assert_array_equal(np.sort(rows), np.arange(32))
    if not shuffle:
        # consecutive rows, whatever the mesh: [0..7] is the first mini-batch on 1 device and on 8
        np.testing.assert_array_equal(steps[0], np.arange(mini))


def test_shuffles_differ_between_epochs_and_repeat_for_the_same_seed():
    cfg = ActorConfig(ppo_mini_batch_size=8, ppo_epochs=2)
    first = mini_batches(32, cfg, np.random.default_rng(5))
    again = mini_batches(32, cfg, np.random.default_rng(5))
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not np.array_equal(np.concatenate(first[:4]), np.concatenate(first[4:]))


@pytest.mark.parametrize("shards", [1, 2, 4, 8])
def test_shard_layout_deals_every_step_in_equal_blocks(shards):
    cfg = ActorConfig(ppo_mini_batch_size=16, ppo_epochs=2)
    steps = mini_batches(32, cfg, np.random.default_rng(1))
    layout = shard_layout(steps, shards)
    assert layout.shape == (shards, len(steps), 16 // shards)  # no shard pads: B / D rows of every step each
    for i, rows in enumerate(steps):
        # the shards' blocks of step i are exactly that step's rows, so the mini-batch is the same on any mesh
        np.testing.assert_array_equal(layout[:, i].reshape(-1), rows)


def sequence_batch(n: int, seed: int = 0) -> Experience:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 5, n)
    attention = np.arange(4)[None, :] < lengths[:, None]
    return Experience(
        prompt_ids=rng.integers(1, 50, (n, 3)).astype(np.int32), prompt_mask=np.ones((n, 3), bool),
        response_ids=np.where(attention, rng.integers(1, 50, (n, 4)), 0).astype(np.int32), response_mask=attention,
        advantages=np.where(attention, rng.normal(size=(n, 4)), 0).astype(np.float32),
    )


@pytest.mark.parametrize("mesh_shape", [(8, 1, 1), (2, 2, 2), (1, 4, 2)])
def test_rows_moved_through_the_devices_equal_a_host_take(mesh_shape):
    """The multi-process path (a jitted gather over global arrays) moves exactly the rows a numpy take would."""
    mesh = make_mesh(*mesh_shape)
    batch = sequence_batch(32)
    cfg = ActorConfig(ppo_mini_batch_size=16, ppo_epochs=2)
    order = shard_layout(mini_batches(32, cfg, np.random.default_rng(2)), mesh.shape["data"] * mesh.shape["fsdp"])
    order = order.reshape(-1)
    arrays = {"ids": batch.response_ids, "mask": batch.response_mask, "adv": batch.advantages}
    moved = take_rows(arrays, order, mesh, through_devices=True)
    for name, array in arrays.items():
        assert moved[name].dtype == array.dtype
        np.testing.assert_array_equal(moved[name], array[order], err_msg=name)
    regrouped = regroup(batch, order, mesh)
    np.testing.assert_array_equal(regrouped.advantages, batch.advantages[order])
    np.testing.assert_array_equal(regrouped.response_attention, batch.response_attention[order])


def test_take_rows_rejects_an_order_the_shards_do_not_divide():
    mesh = make_mesh(8, 1, 1)
    with pytest.raises(ValueError, match="12 rows cannot be split evenly over 8 batch shards"):
        take_rows({"x": np.zeros(8)}, np.arange(12) % 8, mesh, through_devices=True)
    assert jax.device_count() == 8


@pytest.mark.parametrize("role,use_kl_loss,expected", [
    # rollout_log_prob: the actor reports the rollout_corr/* metrics in every rollout_correction mode
    ("actor", False, {"old_log_prob", "advantages", "rollout_log_prob"}),
    ("actor", True, {"old_log_prob", "advantages", "rollout_log_prob", "ref_log_prob"}),
    ("critic", False, {"values", "returns"}),
])
def test_each_update_receives_only_the_arrays_its_loss_reads(role, use_kl_loss, expected):
    from jppo.engine import CriticConfig, step_micro_batches

    rng = np.random.default_rng(4)
    batch = sequence_batch(16)
    per_token = {name: rng.normal(size=(16, 4)).astype(np.float32) for name in
                 ("old_log_prob", "ref_log_prob", "advantages", "values", "returns", "rollout_log_prob")}
    batch = dataclasses.replace(batch, **per_token)
    cfg = (ActorConfig(ppo_mini_batch_size=8, use_kl_loss=use_kl_loss) if role == "actor"
           else CriticConfig(ppo_mini_batch_size=8))
    steps = step_micro_batches(batch, cfg, make_mesh(2, 1, 1, devices=jax.devices()[:2]), np.random.default_rng(0))
    carried = lambda step: {name for name in PER_TOKEN_FIELDS if getattr(step.slots, name) is not None}  # noqa: E731
    assert all(carried(step) == expected | {"response_mask"} for step in steps)
