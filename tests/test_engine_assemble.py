"""Micro-batches assembled on the devices: the same arrays as the host cut, and rows that cross to the devices once.

An update (and a forward pass) sends the batch's rows once, carrying only what its loss reads; every cut of those
rows (each epoch's mini-batches, each forward pass) then costs only its cut: one int32 row id and offset per slot.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import numpy as np
import pytest
from engine_cases import ragged_batch, tiny_config
from flax import nnx

from jppo.core.experience import PER_TOKEN_FIELDS
from jppo.engine import (
    ActorConfig,
    CriticConfig,
    UpdateStep,
    actor_loss_fn,
    critic_loss_fn,
    init_train_state,
    run_updates,
    step_micro_batches,
)
from jppo.engine.assemble import assemble, device_rows, host_rows
from jppo.engine.microbatch import cut_micro_batches, make_micro_batches, stack_micro_batches
from jppo.engine.objectives import loss_inputs
from jppo.models.decoder import CausalLM
from jppo.models.sharding import create_model
from jppo.models.value import ValueModel
from jppo.parallel.mesh import make_mesh

FIELDS = ("old_log_prob", "ref_log_prob", "advantages", "values", "returns")


def float32_batch(seed: int, n: int = 16, length: int = 6):
    batch = ragged_batch(seed, n=n, length=length)
    rng = np.random.default_rng(seed + 100)
    per_token = {name: np.asarray(getattr(batch, name), np.float32) for name in FIELDS}
    per_token["rollout_log_prob"] = -rng.random(batch.response_ids.shape).astype(np.float32)
    return dataclasses.replace(batch, **per_token)


def mesh_of(shards: int):
    return make_mesh(shards, 1, 1, devices=jax.devices()[:shards])


def assert_same_arrays(device, host):
    """Every array of the host-built micro-batches, value and dtype, in the assembled ones (``row_ids`` aside)."""
    host = host.device_arrays()
    assert jax.tree.structure(device) == jax.tree.structure(host)
    for (path, expected), actual in zip(jax.tree_util.tree_leaves_with_path(host), jax.tree.leaves(device)):
        actual = np.asarray(actual)
        assert actual.dtype == expected.dtype, path
        np.testing.assert_array_equal(actual, expected, err_msg=str(path))


@pytest.mark.parametrize("shards", [1, 2, 4])
@pytest.mark.parametrize("sizes", [dict(micro_batch_size=1), dict(micro_batch_size=4), dict(max_token_len=11),
                                 dict(max_token_len=40)])
def test_assembled_micro_batches_equal_the_host_cut(shards, sizes):
    batch = float32_batch(shards)
    mesh = mesh_of(shards)
    fields = ("old_log_prob", "advantages")
    cut = cut_micro_batches(batch.lengths(), shards, **sizes)
    micro = assemble(device_rows(batch, fields, mesh), cut, mesh, sizes.get("max_token_len"))
    host = make_micro_batches(dataclasses.replace(batch.keep_per_token(fields), group_ids=None), shards, **sizes)
    assert_same_arrays(micro, host)
    np.testing.assert_array_equal(cut[0], host.row_ids)


def test_forward_pass_rows_carry_the_tokens_alone():
    batch = float32_batch(0)
    mesh = mesh_of(2)
    cut = cut_micro_batches(batch.lengths(), 2, max_token_len=16)
    micro = assemble(device_rows(batch, None, mesh), cut, mesh, 16)
    assert micro.slots is None
    assert_same_arrays(micro, make_micro_batches(batch, 2, max_token_len=16).token_rows())


@pytest.mark.parametrize("shards", [2, 4])
@pytest.mark.parametrize("role,sizes", [
    ("actor", dict(ppo_micro_batch_size=2)), ("actor", dict(use_dynamic_bsz=True, ppo_max_token_len=13)),
    ("critic", dict(use_dynamic_bsz=True, ppo_max_token_len=24)),
])
def test_the_stacked_step_cut_assembles_to_the_host_s_micro_batches_of_every_epoch(shards, role, sizes):
    """Shuffled mini-batches of three epochs: rows move between shards, and each step is the host's cut."""
    from jppo.engine.driver import global_lengths, stacked_step_cut

    batch = float32_batch(7)
    mesh = mesh_of(shards)
    config = ActorConfig if role == "actor" else CriticConfig
    cfg = config(ppo_mini_batch_size=8, ppo_epochs=3, use_kl_loss=True, **sizes) if role == "actor" else config(
        ppo_mini_batch_size=8, ppo_epochs=3, **sizes)
    cut = stacked_step_cut(global_lengths(batch, mesh), cfg, mesh, np.random.default_rng(3))
    micro = assemble(device_rows(batch, loss_inputs(cfg), mesh), cut, mesh,
                     cfg.ppo_max_token_len if cfg.use_dynamic_bsz else None)
    assert_same_arrays(micro, stack_micro_batches(step_micro_batches(batch, cfg, mesh, np.random.default_rng(3))))


@pytest.mark.parametrize("role,use_kl_loss,expected", [
    ("actor", False, {"old_log_prob", "advantages", "rollout_log_prob"}),
    ("actor", True, {"old_log_prob", "advantages", "rollout_log_prob", "ref_log_prob"}),
    ("critic", False, {"values", "returns"}),
])
def test_the_rows_an_update_sends_carry_only_its_loss_inputs(role, use_kl_loss, expected):
    cfg = ActorConfig(use_kl_loss=use_kl_loss) if role == "actor" else CriticConfig()
    rows = host_rows(float32_batch(0), loss_inputs(cfg))
    assert {name for name in PER_TOKEN_FIELDS if getattr(rows, name) is not None} == expected | {"response_mask"}
    assert rows.group_ids is None


@contextlib.contextmanager
def host_to_device_bytes():
    """Counts the bytes of host values that land on the devices through ``jax.make_array_from_process_local_data``
    and ``jax.device_put`` (every way jppo places host data), summed over the devices that receive them."""
    counted = [0]
    make_array, device_put = jax.make_array_from_process_local_data, jax.device_put

    def landed(out):
        return sum(shard.data.nbytes for leaf in jax.tree.leaves(out) for shard in leaf.addressable_shards)

    def counting_make_array(sharding, local_data, global_shape=None):
        out = make_array(sharding, local_data, global_shape)
        counted[0] += landed(out)
        return out

    def counting_device_put(x, *args, **kwargs):
        out = device_put(x, *args, **kwargs)
        for leaf, placed in zip(jax.tree.leaves(x), jax.tree.leaves(out)):
            if not isinstance(leaf, jax.Array):
                counted[0] += landed(placed)
        return out

    jax.make_array_from_process_local_data, jax.device_put = counting_make_array, counting_device_put
    try:
        yield counted
    finally:
        jax.make_array_from_process_local_data, jax.device_put = make_array, device_put


@pytest.mark.parametrize("role", ["actor", "critic"])
@pytest.mark.parametrize("sizes", [dict(ppo_micro_batch_size=2), dict(use_dynamic_bsz=True, ppo_max_token_len=48)])
def test_an_update_sends_its_rows_once_and_each_epoch_only_its_plan(role, sizes):
    """The bytes an update sends to the devices are the rows with the loss's fields (computed here from the batch's
    shape) plus less than one per-token field for the cuts of ALL its epochs: an extra epoch re-sends no rows."""
    shards, n, p, length = 2, 16, 5, 40
    batch = float32_batch(1, n=n, length=length)
    mesh = mesh_of(shards)
    model_cls, loss_fn, config = ((CausalLM, actor_loss_fn, ActorConfig) if role == "actor"
                                  else (ValueModel, critic_loss_fn, CriticConfig))
    field = n * length * 4  # one float32 per-token field
    tokens = n * p * (4 + 1) + n * length * (4 + 1)  # int32 ids and bool masks of prompts and responses
    for epochs in (1, 3):
        cfg = config(ppo_mini_batch_size=8, ppo_epochs=epochs, loss_scale_factor=float(length), **sizes)
        graphdef, params = nnx.split(create_model(model_cls, tiny_config("float32"), mesh, seed=0), nnx.Param)
        step = UpdateStep(graphdef, loss_fn(cfg), cfg, mesh, role)
        state = init_train_state(params, cfg, mesh)
        rows = tokens + field * len(loss_inputs(cfg)) + n * length  # + the response mask (bool)
        with host_to_device_bytes() as sent:
            run_updates(step, state, batch, cfg, mesh, np.random.default_rng(0))
        assert rows <= sent[0] < rows + field, (epochs, sent[0], rows)


@pytest.mark.parametrize("sizes", [dict(micro_batch_size=2), dict(max_token_len=24)])
def test_forward_pass_on_assembled_micro_batches_equals_the_host_cut(sizes):
    """Log-probs through the device-assembled micro-batches and the on-device scatter to row order are those of the
    host-built micro-batches scattered back on the host, bit for bit; the token rows may be shared by passes."""
    from jppo.engine import forward_batch, log_prob_fn
    from jppo.engine.layout import place
    from jppo.engine.microbatch import scatter_back

    batch = float32_batch(3)
    mesh = mesh_of(2)
    graphdef, params = nnx.split(create_model(CausalLM, tiny_config("float32"), mesh, seed=1), nnx.Param)
    fn = log_prob_fn(graphdef, temperature=0.7, chunk_size=4)
    host = make_micro_batches(batch, 2, **sizes)
    with jax.set_mesh(mesh):
        slots = np.asarray(fn(params, place(host.token_rows(), mesh)))
    expected = np.where(batch.response_mask, scatter_back(slots, host.row_ids, batch.num_sequences), 0.0)
    tokens = device_rows(batch, None, mesh)
    for rows in (None, tokens, tokens):
        np.testing.assert_array_equal(forward_batch(fn, params, batch, mesh, rows=rows, **sizes), expected)
