"""The bitwise update (jppo/engine/bitwise.py): an optimizer step's gradient, metrics and new weights are the same
bits on 1, 2, 4 and 8 devices, with the parameters whole or split over fsdp, and under every fixed micro-batch cut;
the default step's are not (so the equality can fail), and both are the same update to float32 rounding."""

import pathlib

import jax
import numpy as np
import pytest
from engine_cases import mesh_of, ragged_batch, tiny_config
from flax import nnx

from jppo.config import ConfigError, check_mesh, load_config
from jppo.config.views import engine_view, forward_micro_batching
from jppo.core.settings import OptimConfig
from jppo.engine import (
    ActorConfig,
    CriticConfig,
    UpdateStep,
    actor_loss_fn,
    critic_loss_fn,
    init_train_state,
    run_updates,
)
from jppo.models.decoder import CausalLM
from jppo.models.sharding import create_model
from jppo.models.value import ValueModel

N = 16
# (data, fsdp, tensor) and the sequences per shard in one micro-batch: K = N / shards / m micro-batches. One device
# whole and in 4 micro-batches, 2 devices of one sequence per micro-batch, 8 devices, the weights split over fsdp.
LAYOUTS = [((1, 1, 1), 16), ((1, 1, 1), 4), ((2, 1, 1), 1), ((8, 1, 1), 2), ((2, 2, 1), 2)]
ADAM = OptimConfig(name="adamw", lr=1e-2, grad_clip=1.0)


def update(role: str, mesh_shape, micro: int, bitwise: bool):
    """The first optimizer step of ``role`` on the ragged float32 batch: metrics, gradient and new weights."""
    mesh = mesh_of(mesh_shape)
    model = create_model(ValueModel if role == "critic" else CausalLM, tiny_config("float32"), mesh, seed=0)
    graphdef, params = nnx.split(model, nnx.Param)
    settings = dict(ppo_mini_batch_size=N, ppo_micro_batch_size=micro, shuffle=False, optim=ADAM,
                    loss_agg_mode="token-mean", loss_scale_factor=6.0, bitwise=bitwise)
    cfg = CriticConfig(cliprange_value=0.2, **settings) if role == "critic" else ActorConfig(entropy_coeff=0.01,
                                                                                            **settings)
    loss = (critic_loss_fn if role == "critic" else actor_loss_fn)(cfg)
    state = init_train_state(params, cfg, mesh, keep_gradient=True)
    step = UpdateStep(graphdef, loss, cfg, mesh, role, keep_gradient=True)
    state, metrics, gradients = run_updates(step, state, ragged_batch(7), cfg, mesh, np.random.default_rng(0))
    as_numpy = lambda tree: jax.tree.map(np.asarray, jax.device_get(tree))  # noqa: E731
    return as_numpy(metrics), as_numpy(jax.tree.map(lambda g: g[0], gradients)), as_numpy(state.params)


def same_bits(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_the_bitwise_step_is_the_same_bits_on_every_mesh_and_cut():
    """The actor's step (the critic's, and both roles' whole runs: tests/test_whole_run.py)."""
    role = "actor"
    first = update(role, *LAYOUTS[0], bitwise=True)
    for layout in LAYOUTS[1:]:
        other = update(role, *layout, bitwise=True)
        for what, a, b in zip(("metrics", "gradient", "weights"), first, other):
            assert same_bits(a, b), (role, layout, what)
    # the default step on one device and on eight: the same update to float32 rounding, not the same bits
    one, eight = update(role, *LAYOUTS[0], bitwise=False), update(role, *LAYOUTS[3], bitwise=False)
    assert not same_bits(one[1], eight[1])
    for a, b in zip(jax.tree.leaves(first[1]), jax.tree.leaves(one[1])):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-8)


QUICKSTART = pathlib.Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"


@pytest.mark.parametrize("overrides,devices,message", [
    (["trainer.deterministic=bitwse"], 1, "trainer.deterministic='bitwse' is not valid (did you mean 'bitwise'?); "
                                          "valid: off, bitwise"),
    (["actor.use_dynamic_bsz=true"], 1, "actor.use_dynamic_bsz=True with trainer.deterministic='bitwise': its sums "
                                        "run one sequence per row in a fixed order (use ppo_micro_batch_size)"),
    (["rollout.max_num_seqs=32"], 1, "rollout.max_num_seqs=32 with trainer.deterministic='bitwise': the mode samples "
                                     "with jppo's sampler, each prompt alone (rollout.engine: jppo, "
                                     "rollout.max_num_seqs: 0)"),
    (["mesh.data=4", "mesh.tensor=2"], 8, "mesh.tensor=2 with trainer.deterministic='bitwise': it splits a sum the "
                                          "mode keeps in one order (use mesh.data and mesh.fsdp)"),
    (["mesh.data=6"], 6, "mesh.data x mesh.fsdp = 6 batch shards with trainer.deterministic='bitwise': a power of "
                         "two (the devices' sums meet in a binary tree)"),
])
def test_what_the_bitwise_mode_cannot_run_on_is_one_line_at_load(overrides, devices, message):
    with pytest.raises(ConfigError) as error:
        cfg = load_config(QUICKSTART, ["trainer.deterministic=bitwise", *overrides])
        check_mesh(cfg, devices)
    assert str(error.value) == message


def test_off_however_yaml_spells_it_is_the_default_run():
    for written in ("off", "false", "no", "'off'"):
        cfg = load_config(QUICKSTART, [f"trainer.deterministic={written}"])
        assert engine_view(cfg, "actor").bitwise is False and "bitwise" not in forward_micro_batching(cfg, "actor")
