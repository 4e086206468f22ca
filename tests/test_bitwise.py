"""The bitwise update (jppo/engine/bitwise.py): an optimizer step's gradient, metrics and new weights are the same
bits on 1, 2, 4 and 8 devices, with the parameters whole or split over fsdp, and under every fixed micro-batch cut;
the default step's are not (so the equality can fail), and both are the same update to float32 rounding."""

import contextlib
import dataclasses
import pathlib

import jax
import jax.numpy as jnp
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
from jppo.models.attention import normalized_by_product
from jppo.models.config import ModelConfig
from jppo.models.decoder import CausalLM
from jppo.models.log_probs import token_log_probs
from jppo.models.sharding import create_model
from jppo.models.value import ValueModel
from jppo.rollout.decode import generate
from jppo.rollout.params import SamplingParams

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
    (["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len=12"], 1,
     "actor.ppo_max_token_len=12 with trainer.deterministic='bitwise': the mode's passes hold one sequence, of up to "
     "13 tokens (data.max_prompt_length + rollout.max_response_length)"),
    (["actor.routing_replay=rollout"], 1, "actor.routing_replay='rollout' with trainer.deterministic='bitwise': the "
                                          "mode's sampler routes every token as the trainer does, nothing to replay "
                                          "(use none)"),
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


def sampled_and_scored(config: ModelConfig, bitwise: bool):
    """Three responses to each of 5 ragged left-padded prompts (and an empty one) sampled by jppo's sampler (each
    prompt alone with ``bitwise``), then each row's log-probs of its own tokens by the trainer: its forward pass
    and the update's (under ``value_and_grad``, an entropy term beside it, as the actor's loss takes them), one row
    per pass as the bitwise forward passes and update run. Returns the response mask, the sampler's log-probs and
    the two trainer's."""
    model = CausalLM(config, rngs=nnx.Rngs(3))
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(1)
    width, n, new = 7, 3, 6
    lengths = np.array([7, 2, 5, 0, 1, 4])
    mask = np.arange(width)[None, :] >= (width - lengths)[:, None]
    ids = np.where(mask, rng.integers(1, config.vocab_size, (6, width)), 0).astype(np.int32)
    params = SamplingParams(max_new_tokens=new, n=n, temperature=0.9, eos_token_ids=(3,), pad_token_id=0,
                            bitwise=bitwise)
    out = generate(model, ids, mask, jax.random.key(5), params)
    response, sampled = np.asarray(out.response_mask), np.asarray(out.log_probs)
    real = np.concatenate([np.repeat(mask, n, axis=0), response], axis=1)
    tokens = np.where(real, np.concatenate([np.repeat(ids, n, axis=0), np.asarray(out.response_ids)], 1), 0)
    rows = (tokens, np.maximum(np.cumsum(real, axis=1) - 1, 0), real.astype(np.int32),
            np.concatenate([tokens[:, 1:], np.zeros((len(tokens), 1), np.int32)], axis=1))
    context = normalized_by_product if bitwise else contextlib.nullcontext

    def log_probs(state, *row, with_entropy=False):
        with context():
            return token_log_probs(nnx.merge(graphdef, state), *row, temperature=0.9, with_entropy=with_entropy)

    def loss(state, *row):
        values, entropy = log_probs(state, *row, with_entropy=True)
        return jnp.sum(values * row[2]) + 0.1 * jnp.sum(entropy), values

    forward, grad = jax.jit(lambda *a: log_probs(*a)[0]), jax.jit(jax.value_and_grad(loss, has_aux=True))
    one = lambda i: tuple(x[i:i + 1] for x in rows)  # noqa: E731
    passes = [np.concatenate([np.asarray(fn(state, *one(i))) for i in range(len(tokens))])[:, width - 1:-1]
              for fn in (forward, lambda *a: grad(*a)[0][1])]
    return response, sampled, *passes


MOE = dataclasses.replace(tiny_config("float32"), model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=8, mlp_only_layers=(0,), qk_norm=True)


@pytest.mark.parametrize("config", [tiny_config("float32"), MOE], ids=["dense", "experts"])
def test_the_samplers_log_probs_are_the_trainers_bits(config):
    """trainer.deterministic=bitwise: every sampled token's log-prob (temperature 0.9, rows ending at an EOS or at
    6 tokens, an empty prompt among them) is the trainer's forward pass's and its update's, bit for bit
    (``rollout_corr/kl`` exactly 0, the first micro-step's ratio exactly 1); with experts, the rows route alike
    without a record to replay. The default sampler's are not the default forward pass's bits (the equality can
    fail), only equal to float32 rounding."""
    response, sampled, forward, update = sampled_and_scored(config, bitwise=True)
    assert response.sum() > 40 and not response.all()  # rows of several lengths
    for trainer in (forward, update):
        assert np.array_equal(np.where(response, trainer, 0.0), sampled)
    response, sampled, forward, _ = sampled_and_scored(config, bitwise=False)
    assert not np.array_equal(np.where(response, forward, 0.0), sampled)
    np.testing.assert_allclose(np.where(response, forward, 0.0), sampled, rtol=0, atol=2e-6)
