"""Checkpoints: bit-exact round trip of a real TrainState, restore onto other meshes, pruning, atomic commits.

Every comparison is exact (``assert_array_equal`` plus dtype): a checkpoint stores bytes, nothing may round.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from jppo.engine.state import TrainState
from jppo.parallel.mesh import make_mesh
from jppo.run.checkpoint import CheckpointManager, resolve_resume

REPO = Path(__file__).resolve().parents[1]
META = {"data_position": 96, "kl_coef": 0.0012, "config": {"actor": {"lr": 1e-2}}, "metrics": {"reward/mean": 0.25}}


def place(tree, mesh, matrix_spec: P):
    """Matrices (the kernel and its optimizer moments) laid out by ``matrix_spec``, everything else replicated."""
    return jax.tree.map(
        lambda x: jax.device_put(x, NamedSharding(mesh, matrix_spec if x.ndim == 2 else P())), tree
    )


def abstract_on(mesh, matrix_spec: P):
    """What a new run passes: ``jax.eval_shape`` of its initializer plus the shardings it wants."""
    def with_sharding(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, matrix_spec if x.ndim == 2 else P()))

    return jax.tree.map(with_sharding, jax.eval_shape(trained_state))


def host_copy(tree):
    return jax.tree.map(np.asarray, tree)


def assert_trees_equal(actual, expected):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        assert np.asarray(a).dtype == np.asarray(e).dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


def trained_state() -> dict:
    """Actor TrainState of a tiny linear model, caught mid-accumulation (moments and accumulators all non-zero)."""
    params = nnx.state(nnx.Linear(8, 4, rngs=nnx.Rngs(0)), nnx.Param)
    tx = optax.MultiSteps(optax.adamw(1e-2), every_k_schedule=2, use_grad_mean=False)
    opt_state = tx.init(params)
    for seed in range(3):  # one applied step (2 micro-batches) and half of the next
        grads = jax.tree.map(lambda p: jax.random.normal(jax.random.key(seed), p.shape, p.dtype), params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = jax.tree.map(jnp.add, params, updates)
    actor = TrainState(params=params, opt_state=opt_state, step=jnp.ones((), jnp.int32))
    return {"actor": actor, "rng": jax.random.key_data(jax.random.key(7))}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One checkpoint (step 5) of a state sharded over an (8,) mesh: kernel rows split 8 ways."""
    directory = tmp_path_factory.mktemp("run") / "checkpoints"
    state = place(trained_state(), make_mesh(data=1, fsdp=8), P("fsdp", None))
    with CheckpointManager(directory) as manager:
        manager.save(5, state, META)
    return directory, host_copy(state)


def test_state_is_mid_accumulation(saved):
    # Guards the round-trip tests below: they must compare non-trivial optimizer state.
    _, expected = saved
    opt_state = expected["actor"].opt_state
    assert int(opt_state.mini_step) == 1 and int(opt_state.gradient_step) == 1
    assert all(np.any(leaf != 0) for leaf in jax.tree.leaves(opt_state.acc_grads))


def test_round_trip_is_bit_exact_on_the_same_mesh(saved):
    directory, expected = saved
    target = abstract_on(make_mesh(data=1, fsdp=8), P("fsdp", None))
    with CheckpointManager(directory) as manager:
        assert manager.latest_step() == 5 and manager.all_steps() == [5]
        state, meta = manager.restore(5, target)
    assert_trees_equal(state, expected)
    assert isinstance(state["actor"], TrainState) and isinstance(state["actor"].params, nnx.State)
    assert meta == META


@pytest.mark.parametrize("layout", ["mesh_2x4", "single_device"])
def test_restores_onto_another_layout(saved, layout):
    directory, expected = saved
    if layout == "mesh_2x4":
        target = abstract_on(make_mesh(data=2, fsdp=4), P("data", "fsdp"))
    else:
        single = SingleDeviceSharding(jax.devices()[0])
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=single), expected)
    with CheckpointManager(directory) as manager:
        state, meta = manager.restore(5, target)
    assert_trees_equal(state, expected)
    for leaf, abstract in zip(jax.tree.leaves(state), jax.tree.leaves(target)):
        assert leaf.sharding.is_equivalent_to(abstract.sharding, leaf.ndim)
    assert meta == META


def test_restore_into_concrete_arrays_and_meta_only(saved):
    directory, expected = saved
    template = jax.tree.map(jnp.zeros_like, expected)  # a fresh state laid out as the new run wants
    with CheckpointManager(directory) as manager:
        state, _ = manager.restore(5, template)
        assert manager.restore_meta(5) == META
    assert_trees_equal(state, expected)


def test_resolve_resume(saved, tmp_path):
    directory, expected = saved
    assert resolve_resume("never", directory) is None
    assert resolve_resume("auto", directory) == 5
    assert resolve_resume("auto", tmp_path / "absent") is None
    assert resolve_resume("auto", tmp_path) is None
    assert resolve_resume(str(directory / "5"), tmp_path) == directory / "5"
    with pytest.raises(ValueError, match=r"trainer\.resume=.*absent.*no such checkpoint"):
        resolve_resume(str(tmp_path / "absent"), directory)
    with pytest.raises(ValueError, match=r"trainer\.resume=.*not a complete checkpoint"):
        resolve_resume(str(directory), directory)  # the checkpoints' directory, not one checkpoint in it
    assert resolve_resume(str(directory.parent), tmp_path) == directory / "5"  # a run directory: its newest
    with pytest.raises(ValueError, match=r"trainer\.resume is empty; valid: auto, never"):
        resolve_resume("", directory)


def test_restore_from_a_checkpoint_path_of_another_run(saved, tmp_path):
    directory, expected = saved
    with CheckpointManager(tmp_path / "new_run") as manager:
        target = abstract_on(make_mesh(data=4, fsdp=2), P(None, "fsdp"))
        state, meta = manager.restore(resolve_resume(str(directory / "5"), manager.directory), target)
        assert manager.all_steps() == []
    assert_trees_equal(state, expected)
    assert meta == META


def test_max_to_keep_prunes_oldest(tmp_path):
    state = {"x": jnp.arange(4.0)}
    with CheckpointManager(tmp_path, max_to_keep=2) as manager:
        for step in (10, 20, 30):
            assert manager.save(step, {"x": state["x"] + step}, {"step": step}) == tmp_path / str(step)
        assert manager.all_steps() == [20, 30]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["20", "30"]
    with CheckpointManager(tmp_path, max_to_keep=2) as reopened:
        assert reopened.latest_step() == 30
        restored, meta = reopened.restore(20, state)
    np.testing.assert_array_equal(restored["x"], np.arange(4.0) + 20)
    assert meta == {"step": 20}


def test_bad_requests_fail_with_one_line(tmp_path):
    with CheckpointManager(tmp_path) as manager:
        manager.save(3, {"x": jnp.zeros(2)}, {})
        with pytest.raises(KeyError, match=r"no checkpoint step 4 in .*committed steps: \[3\]"):
            manager.restore(4, {"x": jnp.zeros(2)})
        with pytest.raises(ValueError, match="checkpoint step 3 is not after the latest step 3"):
            manager.save(3, {"x": jnp.zeros(2)}, {})
        with pytest.raises(ValueError, match="meta of step 5 is not JSON-serializable"):
            manager.save(5, {"x": jnp.zeros(2)}, {"when": object()})
        assert manager.all_steps() == [3]
        with pytest.raises(ValueError, match=r"target\['x'\] = ShapeDtypeStruct.* has no sharding"):
            manager.restore(3, {"x": jax.ShapeDtypeStruct((2,), jnp.float32)})  # jax.eval_shape without shardings
    with pytest.raises(ValueError, match="max_to_keep=0"):
        CheckpointManager(tmp_path, max_to_keep=0)


# Saves step 1, then dies by SIGKILL in orbax's commit of step 2 after both items were committed inside the
# temporary step directory: every file of step 2 is written, only the final rename is missing -- the worst moment
# for a preemption. With an asynchronous save (argv[2] == "async") the commit runs on orbax's background thread:
# it is held there until the main thread has seen ``save`` return with step 2 uncommitted (printing so), then the
# kill comes while the main thread waits for the save (as the next save or the end of the run does).
KILLED_MID_SAVE = textwrap.dedent(
    """
    import os, signal, sys, threading
    import jax.numpy as jnp
    from orbax.checkpoint._src.path import atomicity
    from jppo.run.checkpoint import CheckpointManager, committed_steps

    background = sys.argv[2] == "async"
    manager = CheckpointManager(sys.argv[1], async_save=background)
    manager.save(1, {"x": jnp.arange(3.0)}, {"step": 1})

    commit, returned = atomicity.AtomicRenameTemporaryPath.finalize, threading.Event()

    async def killed_at_step_commit(self):
        if self.get_final().name == "2":
            if background:
                returned.wait(60)
            os.kill(os.getpid(), signal.SIGKILL)
        await commit(self)

    atomicity.AtomicRenameTemporaryPath.finalize = killed_at_step_commit
    manager.save(2, {"x": jnp.arange(3.0) + 1}, {"step": 2})
    if background:
        print("returned before the commit, committed:", committed_steps(sys.argv[1]), flush=True)
        returned.set()
        manager.wait()
    """
)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_save_killed_before_commit_is_never_picked_up(tmp_path, mode):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    result = subprocess.run(
        [sys.executable, "-c", KILLED_MID_SAVE, str(tmp_path), mode], env=env, capture_output=True, text=True,
        timeout=120,
    )
    assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]
    if mode == "async":  # save(2) returned while its commit was pending, step 1 the newest committed
        assert "returned before the commit, committed: [1]" in result.stdout, result.stdout + result.stderr[-2000:]
    partial = tmp_path / "2.orbax-checkpoint-tmp"
    assert (partial / "state").is_dir() and (partial / "meta").is_dir()  # the data was there, uncommitted

    assert resolve_resume("auto", tmp_path) == 1
    with pytest.raises(ValueError, match=r"trainer\.resume=.*2\.orbax-checkpoint-tmp.*not a complete checkpoint"):
        resolve_resume(str(partial), tmp_path)
    with CheckpointManager(tmp_path) as manager:
        assert manager.latest_step() == 1 and manager.all_steps() == [1]
        restored, meta = manager.restore(1, {"x": jnp.zeros(3)})
        np.testing.assert_array_equal(restored["x"], np.arange(3.0))
        assert meta == {"step": 1}
        manager.save(3, {"x": jnp.arange(3.0) + 3}, {"step": 3})
        restored, _ = manager.restore(3, {"x": jnp.zeros(3)})
    np.testing.assert_array_equal(restored["x"], np.arange(3.0) + 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "3"]  # the partial save was cleaned up


def test_asynchronous_saves_commit_in_order_and_close_waits(tmp_path):
    """Each asynchronous save is committed before the next starts (orbax waits), pruning still keeps the newest,
    and after ``close`` every save is complete and reads back exactly."""
    with CheckpointManager(tmp_path, max_to_keep=2, async_save=True) as manager:
        for step in (1, 2, 3):
            manager.save(step, {"x": jnp.arange(4.0) * step}, {"step": step})
    assert resolve_resume("auto", tmp_path) == 3
    with CheckpointManager(tmp_path) as manager:
        assert manager.all_steps() == [2, 3]
        for step in (2, 3):
            restored, meta = manager.restore(step, {"x": jnp.zeros(4)})
            np.testing.assert_array_equal(restored["x"], np.arange(4.0) * step)
            assert meta == {"step": step}
