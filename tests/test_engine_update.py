"""The update engine keeps the contract: one optimizer step does not depend on how its mini-batch was cut.

Every case compares the engine (micro-batches scanned inside one jitted step, MultiSteps summing their
gradients, NormStats psum-ed over the batch axes) with a from-scratch whole-batch reference that never touches
the engine (``engine_cases.reference_step``). Runs in float64, so the only differences are summation order:
rtol 1e-9 on parameters after SGD (linear in the gradient) and on metrics. AdamW's first step is
``lr * g / (|g| + eps)``, which amplifies rounding of near-zero gradient entries; there we compare at atol
1e-9 * lr-scale instead of relative.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from engine_cases import mesh_of, ragged_batch, reference_step, tiny_config
from flax import nnx

from jppo.core.masked import global_norm_stats
from jppo.core.settings import OptimConfig
from jppo.engine import (
    ActorConfig,
    CriticConfig,
    UpdateStep,
    actor_loss_fn,
    check_batch_sizes,
    critic_loss_fn,
    init_train_state,
    mini_batch_norm_stats,
    run_updates,
)
from jppo.engine.layout import place
from jppo.engine.microbatch import make_micro_batches
from jppo.losses import AGG_MODES
from jppo.models.decoder import CausalLM
from jppo.models.sharding import create_model
from jppo.models.value import ValueModel
from jppo.parallel.mesh import batch_shards, make_mesh

N = 16
C = 6.0  # loss_scale_factor: the response width


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def engine_step(model_cls, cfg, mesh, batch, seed=0, dtype="float64"):
    """State, metrics and the accumulated gradient (as the optimizer received it) after ``run_updates`` with one
    mini-batch (the whole batch) and one epoch."""
    model = create_model(model_cls, tiny_config(dtype), mesh, seed=seed)
    graphdef, params = nnx.split(model, nnx.Param)
    loss = actor_loss_fn(cfg) if isinstance(cfg, ActorConfig) else critic_loss_fn(cfg)
    role = "actor" if isinstance(cfg, ActorConfig) else "critic"
    state = init_train_state(params, cfg, mesh, keep_gradient=True)
    step = UpdateStep(graphdef, loss, cfg, mesh, role, keep_gradient=True)
    state, metrics, gradients = run_updates(step, state, batch, cfg, mesh, np.random.default_rng(0))
    return state, metrics, jax.tree.map(lambda g: g[0], jax.device_get(gradients))


def reference(model_cls, cfg, batch, seed=0):
    model = create_model(model_cls, tiny_config(), None, seed=seed)
    return reference_step(model, batch, cfg, C)


ADAMW_CLIPPED = OptimConfig(name="adamw", lr=1e-3, grad_clip=1e-3, weight_decay=0.01)
SGD = OptimConfig(name="sgd", lr=0.5, grad_clip=0.0)


def actor_cfg(optim=SGD, **kw):
    base = dict(
        ppo_mini_batch_size=N, shuffle=False, optim=optim, entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1,
        clip_ratio_c=1.5, loss_agg_mode="token-mean", loss_scale_factor=C,
    )
    base.update(kw)
    return ActorConfig(**base)


def critic_cfg(optim=SGD, **kw):
    base = dict(ppo_mini_batch_size=N, shuffle=False, optim=optim, cliprange_value=0.3, loss_agg_mode="token-mean",
                loss_scale_factor=C)
    base.update(kw)
    return CriticConfig(**base)


CUTS = {
    "K1": dict(ppo_micro_batch_size=16),
    "K2": dict(ppo_micro_batch_size=8),
    "K4": dict(ppo_micro_batch_size=4),
    "token-budget": dict(use_dynamic_bsz=True, ppo_max_token_len=18),
}


def per_shard(cut: dict, shards: int) -> dict:
    """The same number of micro-batches K on any mesh: rows per micro-batch per shard shrink with the shards."""
    if "ppo_micro_batch_size" in cut:
        return dict(ppo_micro_batch_size=max(1, cut["ppo_micro_batch_size"] // shards))
    return cut


def assert_params_close(actual, expected, *, rtol=1e-9, atol=0.0):
    chex.assert_trees_all_close(jax.device_get(actual), jax.device_get(expected), rtol=rtol, atol=atol)


# (mesh, cut) pairs: every cut on one device, and each multi-device mesh with a fixed and a token-budget cut,
# so that compile time stays within CI's budget while every mesh and every cut is covered.
CASES = [
    ((1, 1, 1), "K1"), ((1, 1, 1), "K2"), ((1, 1, 1), "K4"), ((1, 1, 1), "token-budget"),
    ((8, 1, 1), "K2"), ((8, 1, 1), "token-budget"),
    ((4, 2, 1), "K4"), ((4, 2, 1), "token-budget"),
    ((2, 2, 2), "K2"), ((2, 2, 2), "token-budget"),
]


@pytest.mark.parametrize("mesh_shape,cut", CASES, ids=[f"{m}-{c}" for m, c in CASES])
@pytest.mark.parametrize("role", ["actor", "critic"])
def test_sgd_step_equals_whole_batch_reference(role, mesh_shape, cut):
    mesh = mesh_of(mesh_shape)
    batch = ragged_batch(0)
    make = actor_cfg if role == "actor" else critic_cfg
    cfg = make(**per_shard(CUTS[cut], batch_shards(mesh)))
    model_cls = CausalLM if role == "actor" else ValueModel
    state, metrics, gradient = engine_step(model_cls, cfg, mesh, batch)
    params, grads, loss, ref_metrics = reference(model_cls, cfg, batch)
    assert_params_close(gradient, grads)
    assert_params_close(state.params, params)
    grad_norm = float(jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(grads))))
    np.testing.assert_allclose(metrics[f"{role}/grad_norm"], grad_norm, rtol=1e-9)
    from jppo.core.metrics import finish

    for name, value in finish(ref_metrics).items():
        np.testing.assert_allclose(metrics[name], float(value), rtol=1e-9, atol=1e-12, err_msg=name)
    assert metrics[f"{role}/skipped_updates"] == 0.0
    assert int(state.step) == 1


@pytest.mark.parametrize("mesh_shape,cut", [((1, 1, 1), "K4"), ((4, 2, 1), "token-budget")])
@pytest.mark.parametrize("role", ["actor", "critic"])
def test_adamw_step_with_active_clipping_equals_reference(role, mesh_shape, cut):
    mesh = mesh_of(mesh_shape)
    batch = ragged_batch(1)
    make = actor_cfg if role == "actor" else critic_cfg
    cfg = make(optim=ADAMW_CLIPPED, **per_shard(CUTS[cut], batch_shards(mesh)))
    model_cls = CausalLM if role == "actor" else ValueModel
    state, metrics, gradient = engine_step(model_cls, cfg, mesh, batch)
    params, grads, _, _ = reference(model_cls, cfg, batch)
    grad_norm = float(jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(grads))))
    assert grad_norm > ADAMW_CLIPPED.grad_clip  # clipping is active
    # clipping and Adam's first step are blind to a gradient scaled by K: check the gradient the optimizer received
    assert_params_close(gradient, grads)
    np.testing.assert_allclose(metrics[f"{role}/grad_norm"], grad_norm, rtol=1e-9)
    # Adam's first step is ~lr * sign(g): compare at a fraction of lr (see module docstring)
    assert_params_close(state.params, params, rtol=0, atol=1e-9 * ADAMW_CLIPPED.lr * 1e3)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_every_loss_mode_is_split_invariant(mode):
    mesh = mesh_of((2, 1, 1))
    batch = ragged_batch(2)
    results = []
    for cut in ("K1", "token-budget"):
        cfg = actor_cfg(loss_agg_mode=mode, **per_shard(CUTS[cut], 2))
        results.append(engine_step(CausalLM, cfg, mesh, batch))
    params, grads, _, _ = reference(CausalLM, actor_cfg(loss_agg_mode=mode), batch)
    for state, metrics, gradient in results:
        assert_params_close(gradient, grads)
        assert_params_close(state.params, params)
    for name in results[0][1]:
        np.testing.assert_allclose(results[0][1][name], results[1][1][name], rtol=1e-9, atol=1e-12, err_msg=name)


def micro_batch_rows(n: int, shards: int, micro: int) -> list[np.ndarray]:
    """Rows of micro-batch k over all shards, for one unshuffled mini-batch of ``n`` rows: shard d holds rows
    ``[d n / D, (d + 1) n / D)`` and its k-th micro-batch the k-th block of ``micro`` of them."""
    per_shard = n // shards
    return [
        np.concatenate([d * per_shard + k * micro + np.arange(micro) for d in range(shards)])
        for k in range(per_shard // micro)
    ]


@pytest.mark.parametrize("mesh_shape", [(1, 1, 1), (2, 1, 1)])
@pytest.mark.parametrize("role", ["actor", "critic"])
def test_legacy_mode_reproduces_verl_per_role(role, mesh_shape):
    """``normalization: per_micro_batch``: every micro-batch normalized by its own counts; the critic sums them (verl
    before PR #6957), the actor averages them (verl's older data-parallel actor). The reference differentiates the
    whole-batch reference loss of each micro-batch's rows on its own, outside the engine, on a ragged batch."""
    mesh = mesh_of(mesh_shape)
    shards = batch_shards(mesh)
    batch = ragged_batch(3)
    micro = 2
    make, model_cls = (actor_cfg, CausalLM) if role == "actor" else (critic_cfg, ValueModel)
    extra = dict(entropy_coeff=0.0, use_kl_loss=False) if role == "actor" else {}
    cfg = make(normalization="per_micro_batch", ppo_micro_batch_size=micro, **extra)
    _, _, gradient = engine_step(model_cls, cfg, mesh, batch)
    pieces = [reference(model_cls, cfg, batch.take(rows))[1] for rows in micro_batch_rows(N, shards, micro)]
    summed = jax.tree.map(lambda *g: sum(g), *pieces)
    expected = jax.tree.map(lambda g: g / len(pieces), summed) if role == "actor" else summed
    assert_params_close(gradient, expected)


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_legacy_mode_with_equal_micro_batches_inflates_the_critic_by_k_and_not_the_actor(role):
    """Pinned on purpose: K equal micro-batches normalized by their own counts give K times the global gradient when
    summed (verl's critic before PR #6957, the bug jppo exists to prevent) and the global gradient when averaged."""
    mesh = mesh_of((1, 1, 1))
    batch = ragged_batch(3, equal=True)
    k = 4
    make, model_cls = (actor_cfg, CausalLM) if role == "actor" else (critic_cfg, ValueModel)
    extra = dict(entropy_coeff=0.0, use_kl_loss=False) if role == "actor" else {}
    _, _, global_gradient = engine_step(model_cls, make(ppo_micro_batch_size=N // k, **extra), mesh, batch)
    legacy_cfg = make(normalization="per_micro_batch", ppo_micro_batch_size=N // k, **extra)
    _, _, legacy_gradient = engine_step(model_cls, legacy_cfg, mesh, batch)
    factor = 1 if role == "actor" else k
    assert_params_close(legacy_gradient, jax.tree.map(lambda g: factor * g, global_gradient))


@pytest.mark.parametrize("poisoned_row", ["first", "last"])
def test_non_finite_micro_batch_skips_the_whole_update(poisoned_row):
    """A NaN on a valid token of one micro-batch skips the mini-batch: parameters and AdamW state untouched, the
    skip counted; and the next clean mini-batch is applied normally (nothing of the NaN is left behind)."""
    mesh = mesh_of((2, 1, 1))
    batch = ragged_batch(4)
    advantages = batch.advantages.copy()
    rows = np.flatnonzero(batch.response_mask.any(-1))
    row = int(rows[0] if poisoned_row == "first" else rows[-1])  # in the first / last micro-batch of its shard
    advantages[row, np.flatnonzero(batch.response_mask[row])[0]] = np.nan
    bad = dataclasses.replace(batch, advantages=advantages)
    cfg = actor_cfg(optim=ADAMW_CLIPPED, ppo_micro_batch_size=2, ppo_mini_batch_size=N)
    model = create_model(CausalLM, tiny_config(), mesh, seed=0)
    graphdef, params = nnx.split(model, nnx.Param)
    state = init_train_state(params, cfg, mesh)
    before = jax.device_get(state)
    step = UpdateStep(graphdef, actor_loss_fn(cfg), cfg, mesh, "actor")
    state, metrics, _ = run_updates(step, state, bad, cfg, mesh, np.random.default_rng(0))
    assert metrics["actor/skipped_updates"] == 1.0
    after = jax.device_get(state)
    chex.assert_trees_all_equal(after.params, before.params)
    chex.assert_trees_all_equal(after.opt_state.inner_opt_state[1].inner_state,
                                before.opt_state.inner_opt_state[1].inner_state)
    assert int(after.step) == 0
    state, metrics, _ = run_updates(step, state, batch, cfg, mesh, np.random.default_rng(0))
    assert metrics["actor/skipped_updates"] == 0.0 and int(state.step) == 1
    assert np.isfinite(metrics["actor/grad_norm"])
    assert all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves(state.params))


def test_norm_stats_psum_in_shard_map_equals_global_sums():
    """The shard_map + psum form and the GSPMD form (sums over the global array) give the same N and S."""
    mesh = mesh_of((4, 2, 1))
    batch = ragged_batch(5)
    micro = make_micro_batches(batch, batch_shards(mesh), max_token_len=18)
    mask = place(micro.slots.response_mask, mesh)
    with jax.set_mesh(mesh):
        by_psum = jax.jit(lambda m: mini_batch_norm_stats(m, C, mesh))(mask)
        by_gspmd = jax.jit(lambda m: global_norm_stats(m.reshape(-1, m.shape[-1]), C))(mask)
    whole = global_norm_stats(jnp.asarray(batch.response_mask), C)
    for stats in (by_psum, by_gspmd):
        assert float(stats.num_tokens) == float(whole.num_tokens) == batch.response_mask.sum()
        assert float(stats.num_seqs) == float(whole.num_seqs) == (batch.response_mask.any(-1)).sum()


@pytest.mark.parametrize(
    "cfg,shards,message",
    [
        (ActorConfig(ppo_mini_batch_size=5), 1, "actor.ppo_mini_batch_size=5 sequences does not divide"),
        (ActorConfig(ppo_mini_batch_size=8), 16, "does not split over 16 batch shards"),
        (ActorConfig(ppo_mini_batch_size=16, ppo_micro_batch_size=3), 2, "ppo_micro_batch_size=3 does not divide"),
        (ActorConfig(ppo_mini_batch_size=16, ppo_micro_batch_size=16), 2, "must be between 1 and the 8"),
    ],
)
def test_batch_sizes_that_do_not_divide_are_rejected(cfg, shards, message):
    with pytest.raises(ValueError, match=message):
        check_batch_sizes(cfg, 32, shards, "actor")


def test_an_update_takes_an_engine_config_with_its_loss_scale_factor():
    """C comes with the config (no separate argument), and a trainer config section (prompts) is refused."""
    from jppo.config import ActorSection
    from jppo.engine import make_update_step

    with pytest.raises(ValueError, match="ActorConfig.loss_scale_factor=None is invalid"):
        make_update_step(None, None, ActorConfig(), None, "actor")
    with pytest.raises(TypeError, match="got ActorSection"):
        make_update_step(None, None, ActorSection(loss_scale_factor=C), None, "actor")


def test_mesh_and_token_budget_errors():
    with pytest.raises(ValueError, match="mesh.data=3 x mesh.fsdp=1 x mesh.tensor=1 x mesh.sequence=1 x "
                                         "mesh.expert=1 = 3 devices, but 8 are available"):
        make_mesh(3, 1, 1)
    with pytest.raises(ValueError, match="ppo_max_token_len=4 is smaller than the longest sequence"):
        make_micro_batches(ragged_batch(0), 2, max_token_len=4)


def test_the_inner_optimizer_runs_once_per_mini_batch(monkeypatch):
    """Clipping, the non-finite check and AdamW run on the accumulated gradient only: once per optimizer step, not
    on every micro-step (counted at run time inside the compiled step), and they receive it in float32."""
    import jppo.engine.optim as optim
    import jppo.engine.update as update_module

    runs = []
    real = optim.inner_optimizer

    def counted_inner(cfg, *args, **kwargs):
        inner = real(cfg, *args, **kwargs)

        def update(updates, state, params=None, **extra_args):
            dtypes = {str(leaf.dtype) for leaf in jax.tree.leaves(updates)}
            jax.debug.callback(lambda: runs.append(dtypes))
            return inner.update(updates, state, params, **extra_args)

        return optax.GradientTransformationExtraArgs(inner.init, update)

    monkeypatch.setattr(update_module, "inner_optimizer", counted_inner)
    mesh = mesh_of((2, 1, 1))
    cfg = actor_cfg(optim=ADAMW_CLIPPED, ppo_micro_batch_size=2, ppo_mini_batch_size=N // 2, ppo_epochs=2)
    state, metrics, _ = engine_step(CausalLM, cfg, mesh, ragged_batch(6), dtype="bfloat16")
    jax.effects_barrier()
    # 2 mini-batches x 2 epochs = 4 optimizer steps of K = 2 micro-batches each (8 rows over 2 shards, 2 per micro)
    assert len(runs) == 4 and int(state.step) == 4
    # bfloat16 parameters and gradients; the summed gradient reaches the optimizer in the float32 accumulator's dtype
    assert {leaf.dtype for leaf in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.bfloat16)}
    assert all(dtypes == {"float32"} for dtypes in runs)


def test_entropy_is_reported_without_a_bonus_and_adds_no_gradient():
    """``actor/entropy`` is logged with ``entropy_coeff: 0`` (the whole mini-batch's token entropy, as with a bonus),
    and the gradient is that of the loss without the entropy term."""
    mesh = mesh_of((2, 1, 1))
    batch = ragged_batch(7)
    cfg = actor_cfg(entropy_coeff=0.0, ppo_micro_batch_size=2)
    _, metrics, gradient = engine_step(CausalLM, cfg, mesh, batch)
    _, grads, _, _ = reference(CausalLM, actor_cfg(entropy_coeff=0.0), batch)
    assert_params_close(gradient, grads)
    _, _, _, with_bonus = reference(CausalLM, actor_cfg(entropy_coeff=0.01), batch)
    from jppo.core.metrics import finish

    np.testing.assert_allclose(metrics["actor/entropy"], float(finish(with_bonus)["actor/entropy"]), rtol=1e-9)


def test_a_skipped_mini_batch_is_left_out_of_the_means_and_counted():
    """One non-finite mini-batch of two: its update is skipped and counted, and the step's metrics are those of the
    applied mini-batch alone, not NaN."""
    mesh = mesh_of((2, 1, 1))
    batch = ragged_batch(8)
    advantages = batch.advantages.copy()
    # unshuffled mini-batches of 8 rows: rows 0-7, then 8-15; a NaN on a valid token of row 12 spoils the second
    row = 12
    advantages[row, np.flatnonzero(batch.response_mask[row])[0]] = np.nan
    bad = dataclasses.replace(batch, advantages=advantages)
    cfg = actor_cfg(optim=ADAMW_CLIPPED, ppo_micro_batch_size=2, ppo_mini_batch_size=N // 2)
    state, metrics, _ = engine_step(CausalLM, cfg, mesh, bad)
    assert metrics["actor/skipped_updates"] == 1.0 and int(state.step) == 1
    assert all(np.isfinite(value) for value in metrics.values()), metrics
    # the same as a run over the clean first mini-batch alone (rows 0-7)
    first = batch.take(np.arange(N // 2))
    _, alone, _ = engine_step(CausalLM, actor_cfg(optim=ADAMW_CLIPPED, ppo_micro_batch_size=2,
                                                  ppo_mini_batch_size=N // 2), mesh, first)
    for name in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/ppo_kl"):
        np.testing.assert_allclose(metrics[name], alone[name], rtol=1e-9, err_msg=name)


def test_warm_up_holds_one_learning_rate_over_the_optimizer_steps_of_a_training_step():
    """``optimizer_steps_per_training_step`` (2 epochs x 2 mini-batches): with ``warmup_steps=2`` every SGD step of
    the first training step moves the parameters by lr/2 times its gradient, and the second by lr."""
    lr = 0.5
    cfg = actor_cfg(optim=dataclasses.replace(SGD, warmup_steps=2), ppo_mini_batch_size=N // 2, ppo_epochs=2,
                    ppo_micro_batch_size=4, optimizer_steps_per_training_step=4)
    mesh = mesh_of((1, 1, 1))
    model = create_model(CausalLM, tiny_config(), mesh, seed=0)
    graphdef, params = nnx.split(model, nnx.Param)
    state = init_train_state(params, cfg, mesh, keep_gradient=True)
    step = UpdateStep(graphdef, actor_loss_fn(cfg), cfg, mesh, "actor", keep_gradient=True)
    batch = ragged_batch(6)
    for expected_lr in (lr / 2, lr):
        before = jax.device_get(state.params)
        state, metrics, gradients = run_updates(step, state, batch, cfg, mesh, np.random.default_rng(0))
        assert metrics["actor/lr"] == pytest.approx(expected_lr, rel=1e-12)
        summed = jax.tree.map(lambda g: np.asarray(g).sum(0), jax.device_get(gradients))  # 4 optimizer steps
        moved = jax.tree.map(lambda a, b, g: a - b + expected_lr * g, jax.device_get(state.params), before, summed)
        assert max(float(np.abs(leaf).max()) for leaf in jax.tree.leaves(moved)) < 1e-9


def spoiled(batch, row: int):
    """``batch`` with a NaN advantage on the first valid token of ``row``: its mini-batch's update is skipped."""
    advantages = batch.advantages.copy()
    advantages[row, np.flatnonzero(batch.response_mask[row])[0]] = np.nan
    return dataclasses.replace(batch, advantages=advantages)


def test_a_skipped_step_does_not_shift_the_schedule_and_the_counter_survives_a_checkpoint(tmp_path):
    """The schedule counts every optimizer step, skipped or not (verl steps its scheduler once per training step
    whatever the gradient). Two unshuffled mini-batches per training step, warm-up over 2 training steps (lr/2,
    then lr): training step 1 skips its second mini-batch (a NaN); training step 2, resumed from a checkpoint of
    step 1, takes both its SGD steps at lr, reports lr, and moves the parameters by lr times its gradients. (Read
    from the count of applied steps, training step 2 would take one step at lr/2 and one at lr.)"""
    from jppo.run.checkpoint import CheckpointManager

    lr = SGD.lr
    cfg = actor_cfg(optim=dataclasses.replace(SGD, warmup_steps=2), ppo_mini_batch_size=N // 2,
                    ppo_micro_batch_size=8, optimizer_steps_per_training_step=2)
    mesh = mesh_of((1, 1, 1))
    graphdef, params = nnx.split(create_model(CausalLM, tiny_config(), mesh, seed=0), nnx.Param)
    step = UpdateStep(graphdef, actor_loss_fn(cfg), cfg, mesh, "actor", keep_gradient=True)
    batch = ragged_batch(8)
    state, metrics, _ = run_updates(step, init_train_state(params, cfg, mesh, keep_gradient=True), spoiled(batch, 12),
                                    cfg, mesh, np.random.default_rng(0))
    assert metrics["actor/skipped_updates"] == 1.0 and metrics["actor/lr"] == pytest.approx(lr / 2, rel=1e-12)
    assert (int(state.step), int(state.opt_state.gradient_step)) == (1, 2)  # applied / taken optimizer steps

    with CheckpointManager(tmp_path) as manager:
        manager.save(1, state, {})
        state, _ = manager.restore(1, init_train_state(params, cfg, mesh, keep_gradient=True))
    assert int(state.opt_state.gradient_step) == 2
    before = jax.device_get(state.params)
    state, metrics, gradients = run_updates(step, state, batch, cfg, mesh, np.random.default_rng(0))
    assert metrics["actor/lr"] == pytest.approx(lr, rel=1e-12)
    summed = jax.tree.map(lambda g: np.asarray(g).sum(0), jax.device_get(gradients))  # both optimizer steps
    moved = jax.tree.map(lambda a, b, g: a - b + lr * g, jax.device_get(state.params), before, summed)
    assert max(float(np.abs(leaf).max()) for leaf in jax.tree.leaves(moved)) < 1e-9  # float64, SGD: rounding only


def test_checkpoints_of_optax_s_own_adamw_chain_restore_with_their_counter(tmp_path):
    """The optimizer state keeps optax's ``adamw`` layout (the one checkpoints written before the schedule read
    ``gradient_step`` hold): such a checkpoint restores into today's state, ``gradient_step`` included."""
    from jppo.engine.optim import record_gradient, skip_if_not_finite
    from jppo.run.checkpoint import CheckpointManager

    cfg = actor_cfg(optim=ADAMW_CLIPPED)
    mesh = mesh_of((1, 1, 1))
    _, params = nnx.split(create_model(CausalLM, tiny_config(), mesh, seed=0), nnx.Param)
    optax_chain = optax.chain(record_gradient(), skip_if_not_finite(optax.chain(
        optax.clip_by_global_norm(ADAMW_CLIPPED.grad_clip), optax.adamw(optax.constant_schedule(ADAMW_CLIPPED.lr)))))
    earlier = optax.MultiSteps(optax_chain, every_k_schedule=1, use_grad_mean=False).init(params)
    earlier = earlier._replace(gradient_step=jnp.asarray(7, jnp.int32))
    with CheckpointManager(tmp_path) as manager:
        manager.save(3, earlier, {})
        restored, _ = manager.restore(3, init_train_state(params, cfg, mesh).opt_state)
    assert int(restored.gradient_step) == 7
    assert jax.tree.structure(restored) == jax.tree.structure(init_train_state(params, cfg, mesh).opt_state)
