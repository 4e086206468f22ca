"""The KL reference is kept in ``ref.param_dtype`` (default: ``model.dtype``), and gives the same log-probs.

It never trains, so with mixed precision (``model.param_dtype: float32``, ``model.dtype: bfloat16``) a float32 copy
wastes half its bytes. Kept in bfloat16, with the norm scales (read in float32) as they were, the reference's
log-probs must be bit for bit those of the float32 copy: the model casts each weight to the compute dtype anyway.
``jppo.plan`` counts exactly the bytes built, on a sharded mesh too.
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jppo.config import ConfigError, check_mesh, load_config
from jppo.models.layers import is_norm_scale
from jppo.models.log_probs import token_log_probs
from jppo.parallel.mesh import make_mesh
from jppo.preflight import memory
from jppo.run import build

QUICKSTART = pathlib.Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
MESH = ("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")


def config(tmp_path, *overrides):
    return load_config(QUICKSTART, [f"trainer.output_dir={tmp_path / 'run'}", "actor.use_kl_loss=true", *overrides])


def built(cfg):
    mesh = make_mesh(*check_mesh(cfg, 8))
    return mesh, build.models(cfg, build.load_inputs(cfg).tokenizer, mesh, roles=("actor",))


def names(state):
    return [(str(path[-1]), variable.value) for path, variable in nnx.to_flat_state(state)]


def device_bytes(state) -> int:
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state))


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """Mixed precision on an 8-device mesh: float32 weights, bfloat16 compute, the reference by default."""
    cfg = config(tmp_path_factory.mktemp("mixed"), "model.dtype=bfloat16", *MESH)
    return cfg, *built(cfg)


def test_the_reference_is_kept_in_the_compute_dtype_with_float32_norm_scales(mixed):
    cfg, mesh, models = mixed
    policy = dict(names(models.actor.params))
    for name, ref in names(models.reference):
        assert ref.dtype == (jnp.float32 if is_norm_scale(name) else jnp.bfloat16), name
        assert ref.sharding == policy[name].sharding, name  # laid out as the policy
    assert any(is_norm_scale(name) for name, _ in names(models.reference))
    planned = memory.memory_plan(cfg, check_mesh(cfg, 8))
    assert planned.term("parameters/reference") == device_bytes(models.reference)
    scales = [x for name, x in names(models.actor.params) if is_norm_scale(name)]
    weights = [x for name, x in names(models.actor.params) if not is_norm_scale(name)]
    assert planned.term("parameters/reference") == device_bytes(weights) // 2 + device_bytes(scales)  # half


def test_its_log_probs_are_bit_for_bit_those_of_a_float32_copy(mixed):
    """On weights whose norm scales are not bfloat16 numbers (a trained policy's, not the initial ones): kept as
    ``kept_in`` keeps them, the log-probs are exactly the float32 copy's; every weight in bfloat16 would not be."""
    _, mesh, models = mixed
    graphdef = nnx.graphdef(models.policy)

    def trained(path, x):
        if not is_norm_scale(str(path[-2].key)):
            return x
        return x * (1 + 1e-3 * jax.random.normal(jax.random.key(len(path)), x.shape, x.dtype))

    full = jax.tree_util.tree_map_with_path(trained, models.actor.params)  # float32, as the reference was kept
    kept = build.kept_in(full, "bfloat16", copy=True)
    naive = jax.tree.map(lambda x: x.astype(jnp.bfloat16), full)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(3, 12, size=(8, 12)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), ids.shape)
    segments = jnp.asarray(np.arange(12)[None] < rng.integers(4, 13, size=(8, 1)), jnp.int32)  # ragged rows
    targets = jnp.roll(ids, -1, axis=1)

    @jax.jit
    def log_probs(params):
        return token_log_probs(nnx.merge(graphdef, params), ids, positions, segments, targets, chunk_size=4)[0]

    with jax.set_mesh(mesh):
        kept, wide, rounded = (np.asarray(log_probs(params)) for params in (kept, full, naive))
    assert kept.dtype == np.float32 and np.all(np.isfinite(kept))
    np.testing.assert_array_equal(kept, wide)
    assert np.any(rounded != wide)  # the norm scales in bfloat16 would change them: the test can tell


def test_float32_default_and_an_explicit_dtype(tmp_path):
    cfg = config(tmp_path, "mesh.data=8")  # the quickstart: float32 compute, so a float32 copy as before
    _, models = built(cfg)
    for (name, ref), (_, actor) in zip(names(models.reference), names(models.actor.params)):
        assert ref.dtype == jnp.float32 and ref is not actor, name  # a copy: the actor's arrays are donated
        np.testing.assert_array_equal(np.asarray(ref), np.asarray(actor))
    cfg = config(tmp_path, "mesh.data=8", "ref.param_dtype=bfloat16")
    kept = memory.memory_plan(cfg, check_mesh(cfg, 8)).term("parameters/reference")
    _, models = built(cfg)
    assert kept == device_bytes(models.reference)
    assert {ref.dtype for name, ref in names(models.reference) if not is_norm_scale(name)} == {jnp.dtype("bfloat16")}


def test_a_bad_reference_dtype_is_one_line_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"ref\.param_dtype.*'float8'"):
        config(tmp_path, "ref.param_dtype=float8")
