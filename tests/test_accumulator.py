"""No gradient accumulator when every optimizer step is one micro-batch (K = 1), and the same steps as with one.

A role whose fixed-size micro-batch is its whole per-shard mini-batch keeps ``MultiSteps``' state without
``acc_grads`` (one float32 copy of the trained parameters less). Its updates must be bit for bit those of the
accumulating state (float32, the production dtype: equality, not a tolerance); a state without an accumulator
given K > 1 micro-batches accumulates in a temporary and matches too; and checkpoints restore across the change
in both directions (one written with an accumulator into a state without, and the reverse, as a resume on a mesh
with another K does).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_cases import ragged_batch, tiny_config
from flax import nnx

from jppo.core.settings import OptimConfig
from jppo.engine import ActorConfig, UpdateStep, actor_loss_fn, init_train_state, run_updates
from jppo.engine.config import fixed_micro_batch_count
from jppo.models.decoder import CausalLM
from jppo.models.sharding import create_model
from jppo.parallel.mesh import make_mesh
from jppo.rewards.kl_penalty import KLControlState
from jppo.run.checkpoint import CheckpointManager, restore_checkpoint, saved_tree
from jppo.run.state import fitted_accumulators, init_run_state, saved_layout

N = 16
ADAMW = OptimConfig(name="adamw", lr=1e-2, grad_clip=1.0, weight_decay=0.01)


def cfg_of(micro: int) -> ActorConfig:
    # two mini-batches of 8 rows: each optimizer step is K = 8 / micro micro-batches on one device
    return ActorConfig(ppo_mini_batch_size=8, ppo_micro_batch_size=micro, optim=ADAMW, entropy_coeff=0.01,
                       loss_agg_mode="token-mean", loss_scale_factor=6.0, optimizer_steps_per_training_step=2)


@pytest.fixture(scope="module")
def setup():
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    graphdef, params = nnx.split(create_model(CausalLM, tiny_config("float32"), mesh, seed=0), nnx.Param)
    return mesh, graphdef, jax.device_get(params)


def train(setup, state_cfg: ActorConfig, cut_cfg: ActorConfig, steps: int = 2):
    """``steps`` training steps of ``cut_cfg``'s cut from a state initialised for ``state_cfg``'s."""
    mesh, graphdef, params = setup
    state = init_train_state(jax.device_put(params), state_cfg, mesh)
    held = state.opt_state.acc_grads is not None
    step = UpdateStep(graphdef, actor_loss_fn(cut_cfg), cut_cfg, mesh, "actor")
    history = []
    for i in range(steps):
        state, metrics, _ = run_updates(step, state, ragged_batch(i), cut_cfg, mesh, np.random.default_rng(i))
        history.append(metrics)
    return held, jax.device_get(state), history


def test_k_is_fixed_by_the_cut_and_the_shards():
    assert fixed_micro_batch_count(cfg_of(8), 1) == 1 and fixed_micro_batch_count(cfg_of(4), 1) == 2
    assert fixed_micro_batch_count(cfg_of(1), 8) == 1  # 8 rows over 8 shards: one row each, one micro-batch
    dynamic = ActorConfig(ppo_mini_batch_size=8, use_dynamic_bsz=True, ppo_max_token_len=10**6)
    assert fixed_micro_batch_count(dynamic, 1) is None  # K follows the tokens: the accumulator stays


def test_without_accumulator_k1_steps_are_bit_for_bit_those_with_one(setup):
    held, lean, lean_metrics = train(setup, cfg_of(8), cfg_of(8))
    assert not held and lean.opt_state.acc_grads is None
    # the same cut (K = 1) through a state that holds an accumulator (made for K = 2)
    held, full, full_metrics = train(setup, cfg_of(4), cfg_of(8))
    assert held and full.opt_state.acc_grads is not None
    chex.assert_trees_all_equal(lean.params, full.params)
    chex.assert_trees_all_equal(lean.opt_state.inner_opt_state, full.opt_state.inner_opt_state)
    assert int(lean.opt_state.gradient_step) == int(full.opt_state.gradient_step) == 4
    assert lean_metrics == full_metrics  # every metric, exactly
    assert any(np.any(a != b) for a, b in zip(jax.tree.leaves(lean.params), jax.tree.leaves(setup[2])))  # trained


def test_a_state_without_accumulator_given_k2_accumulates_in_a_temporary(setup):
    held, lean, lean_metrics = train(setup, cfg_of(8), cfg_of(4))
    assert not held and lean.opt_state.acc_grads is None  # still none after the step
    _, full, full_metrics = train(setup, cfg_of(4), cfg_of(4))
    chex.assert_trees_all_equal(lean.params, full.params)
    assert lean_metrics == full_metrics


@pytest.mark.parametrize("saved_micro,resumed_micro", [(4, 8), (8, 4)], ids=["held-into-none", "none-into-held"])
def test_checkpoints_restore_across_the_accumulator(setup, tmp_path, saved_micro, resumed_micro):
    mesh, graphdef, params = setup
    _, trained, _ = train(setup, cfg_of(saved_micro), cfg_of(8), steps=1)
    kl = KLControlState(coef=jnp.asarray(0.0, jnp.float32))
    saved = init_run_state(jax.device_put(trained), None, kl, 0, mesh)
    with CheckpointManager(tmp_path) as manager:
        manager.save(1, saved, {})
    fresh = init_run_state(init_train_state(jax.device_put(params), cfg_of(resumed_micro), mesh), None, kl, 0, mesh)
    path = tmp_path / "1"
    restored, _ = restore_checkpoint(path, saved_layout(fresh, saved_tree(path)))
    restored = fitted_accumulators(restored, fresh)
    assert jax.tree.structure(restored) == jax.tree.structure(fresh)
    chex.assert_trees_all_equal(jax.device_get(restored.actor.params), trained.params)
    chex.assert_trees_all_equal(jax.device_get(restored.actor.opt_state.inner_opt_state),
                                trained.opt_state.inner_opt_state)
    assert int(restored.actor.opt_state.gradient_step) == 2
    if resumed_micro == 4:  # the resumed run accumulates: its accumulator is the fresh state's zeros
        assert all(not np.any(leaf) for leaf in jax.tree.leaves(jax.device_get(restored.actor.opt_state.acc_grads)))
