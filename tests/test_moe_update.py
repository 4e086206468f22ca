"""The actor update of a model with experts: the load-balancing loss, the router's z-loss and their gradients are
the whole mini-batch's whatever the cut (K micro-batches, token budgets, data shards, the experts split over
mesh.expert), and the expert load is reported as one."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_cases import VOCAB, mesh_of, padded_inputs, ragged_batch
from flax import nnx

import jppo.models.decoder as decoder
import jppo.models.moe as moe
from jppo.core.settings import OptimConfig
from jppo.engine import (
    ActorConfig,
    CriticConfig,
    UpdateStep,
    actor_loss_fn,
    critic_loss_fn,
    init_train_state,
    run_updates,
    sft_loss_fn,
)
from jppo.engine.experts import router_aux_coef
from jppo.models.config import ModelConfig
from jppo.models.decoder import CausalLM
from jppo.models.moe import collect_router_stats, load_balancing_loss, not_recorded
from jppo.models.sharding import create_model
from jppo.models.value import ValueModel

N = 16
SGD = OptimConfig(name="sgd", lr=0.5, grad_clip=0.0)
CUTS = {
    "K=1": dict(ppo_micro_batch_size=N),
    "K=3 uneven (token budget)": dict(use_dynamic_bsz=True, ppo_max_token_len=40),
    "K=2 on data 2 x fsdp 2 x tensor 2": dict(ppo_micro_batch_size=2),
    # mesh.expert: the 4 experts 2 and 1 per device, the tokens exchanged inside the layer (jppo.models.moe)
    "K=2 on data 2 x fsdp 2 x expert 2": dict(ppo_micro_batch_size=1),
    "token budget on fsdp 2 x expert 4": dict(use_dynamic_bsz=True, ppo_max_token_len=20),
}
# (data, fsdp, tensor, sequence, expert)
MESHES = {"K=2 on data 2 x fsdp 2 x tensor 2": (2, 2, 2), "K=2 on data 2 x fsdp 2 x expert 2": (2, 2, 1, 1, 2),
          "token budget on fsdp 2 x expert 4": (1, 2, 1, 1, 4)}


def moe_config(chunk: int = 0) -> ModelConfig:
    # layer 0 dense, layer 1 with 4 experts (top 2); a wide initialization, so that the routing is uneven
    return ModelConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=4,
                       num_kv_heads=2, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=8, mlp_only_layers=(0,), initializer_range=0.5, router_aux_loss_coef=0.3,
                       dtype="float64", param_dtype="float64", expert_chunk_size=chunk)


def update(cut: dict, mesh_shape=(1, 1, 1), batch=None, role="actor", chunk=0, **actor):
    """The first update of the MoE model's ``role`` (actor, sft: the policy's objectives; critic: a value head on
    the same decoder) on ``batch`` under the ``cut``, its exchange in rounds of ``chunk`` tokens: its metrics and
    gradient."""
    mesh = mesh_of(mesh_shape)
    model = create_model(ValueModel if role == "critic" else CausalLM, moe_config(chunk), mesh, seed=0)
    graphdef, params = nnx.split(model, nnx.Param)
    actor = {"router_z_loss_coef": 0.05} | actor  # the z-loss on too, unless a test says otherwise
    settings = dict(ppo_mini_batch_size=N, shuffle=False, optim=SGD, loss_agg_mode="token-mean",
                    loss_scale_factor=6.0, **cut, **actor)
    cfg = CriticConfig(cliprange_value=0.2, **settings) if role == "critic" else ActorConfig(**settings)
    loss = {"actor": actor_loss_fn, "sft": sft_loss_fn, "critic": critic_loss_fn}[role](cfg)
    state = init_train_state(params, cfg, mesh, keep_gradient=True)
    step = UpdateStep(graphdef, loss, cfg, mesh, role, keep_gradient=True)
    batch = ragged_batch(3) if batch is None else batch
    _, metrics, gradients = run_updates(step, state, batch, cfg, mesh, np.random.default_rng(0))
    return metrics, jax.tree.map(lambda g: np.asarray(g[0]), jax.device_get(gradients))


@pytest.fixture(scope="module", autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


@pytest.fixture(scope="module")
def whole(x64):
    return update(CUTS["K=1"])


def whole_batch_router_losses() -> tuple[float, float]:
    """transformers' load-balancing loss, and the z-loss (the mean of logsumexp(router logits)^2 over the valid
    tokens of the layer with experts), of one forward pass over the whole batch in the rollout's padded layout."""
    graphdef, state = nnx.split(create_model(CausalLM, moe_config(), None, seed=0))  # the update's initial weights

    @jax.jit
    def losses(state, inputs):
        with collect_router_stats() as stats:
            nnx.merge(graphdef, state).hidden_states(*inputs)
        counts, probs, tokens, z = stats[0]
        return load_balancing_loss(counts, probs, tokens, moe_config().num_experts), z.sum() / tokens.sum()

    return tuple(float(x) for x in losses(state, padded_inputs(ragged_batch(3))))


def test_the_whole_mini_batch_router_losses_are_reported(whole):
    metrics = whole[0]
    aux, z = whole_batch_router_losses()
    assert metrics["actor/router_aux_loss"] == pytest.approx(aux, rel=1e-12)
    # a share of the whole mini-batch's mean per micro-batch (K = 1 here; the other cuts below equal it)
    assert metrics["actor/router_z_loss"] == pytest.approx(z, rel=1e-12) and z > 0
    assert metrics["actor/router_aux_loss"] > 2.05  # 2 (= k) when even: this routing is not
    assert 1.0 < metrics["actor/expert_load"] < 2.0  # max / mean of the tokens per expert (4 experts, top 2)


def assert_same_update(metrics, gradient, expected_metrics, expected):
    """The router and loss metrics and every gradient leaf equal the expected ones (float64: 1e-9)."""
    for name in ("actor/router_aux_loss", "actor/router_z_loss", "actor/expert_load", "actor/pg_loss",
                 "actor/grad_norm"):
        np.testing.assert_allclose(metrics[name], expected_metrics[name], rtol=1e-9, err_msg=name)
    for (path, leaf), other in zip(jax.tree_util.tree_leaves_with_path(gradient), jax.tree.leaves(expected)):
        np.testing.assert_allclose(leaf, other, rtol=1e-9, atol=1e-13, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("cut", [name for name in CUTS if name != "K=1"])
def test_gradient_and_router_metrics_do_not_depend_on_the_cut(cut, whole):
    metrics, gradient = update(CUTS[cut], MESHES.get(cut, (1, 1, 1)))
    expected_metrics, expected = whole
    assert_same_update(metrics, gradient, expected_metrics, expected)


def test_the_exchange_in_rounds_gives_the_same_update(whole, monkeypatch):
    """model.expert_chunk_size: the experts' exchange over expert 4 in rounds of 3 tokens per device (the last one
    padded), each recomputed in the backward pass, gives the whole batch's update (float64: 1e-9)."""
    rounds = []
    in_rounds = moe.in_rounds
    monkeypatch.setattr(moe, "in_rounds", lambda *args: rounds.append(args[2].shape) or in_rounds(*args))
    cut = "token budget on fsdp 2 x expert 4"
    metrics, gradient = update(CUTS[cut], MESHES[cut], chunk=3)
    assert rounds and all(shape[0] > 3 and shape[0] % 3 for shape in rounds)  # several rounds, the last padded
    assert_same_update(metrics, gradient, *whole)


def test_the_load_balancing_loss_moves_the_router_and_its_coefficient_is_overridable(whole):
    expected_metrics, with_aux = whole
    metrics, without = update(CUTS["K=3 uneven (token budget)"], router_aux_loss_coef=0.0)
    assert "actor/router_aux_loss" not in metrics
    # the same weights route the same tokens, with or without the loss, whatever the cut
    np.testing.assert_allclose(metrics["actor/expert_load"], expected_metrics["actor/expert_load"], rtol=1e-12)
    router = lambda g: np.asarray(g["decoder"]["layers"]["router"])  # noqa: E731
    assert np.abs(router(with_aux) - router(without)).max() > 1e-4 * np.abs(router(without)).max()


def test_a_qwen3_moe_model_without_a_layer_with_experts_has_no_load_balancing_loss():
    """Every layer in mlp_only_layers: the model is dense (a config of one layer, as the fuzzed quickstart_moe
    with model.num_layers=1 is), so there are no router counts to take fractions of, and the loss is off."""
    config = dataclasses.replace(moe_config(), num_layers=1, mlp_only_layers=(0,))
    assert config.sparse_layers == () and config.dense_layers == (0,)
    assert router_aux_coef(ActorConfig(), config) == 0.0
    assert router_aux_coef(ActorConfig(), moe_config()) == 0.3 and router_aux_coef(
        ActorConfig(router_aux_loss_coef=0.1), moe_config()) == 0.1


def replayed_batch():
    """The batch with a routing record (routing replay): 2 distinct experts of 4 for each token, drawn at random
    (another routing than the model's own), a fifth of the tokens not recorded (routed by the model itself)."""
    batch = ragged_batch(3)
    rng = np.random.default_rng(5)
    shape = (batch.num_sequences, batch.prompt_ids.shape[1] + batch.response_ids.shape[1], 1)
    routed = np.argsort(rng.random(shape + (4,)), axis=-1)[..., :2].astype(np.uint8)
    routed[rng.random(shape[:2]) < 0.2] = not_recorded(4)
    return dataclasses.replace(batch, routed_experts=routed)


@pytest.fixture(scope="module")
def replayed_whole(x64):
    return update(CUTS["K=1"], batch=replayed_batch())


def test_with_routing_replay_the_gradient_does_not_depend_on_the_cut(replayed_whole, whole):
    """Replayed experts route the tokens wherever the micro-batch cut and the expert axis put them (here K=2 on
    data 2 x fsdp 2 x expert 2; the token-budget layout of the record: tests/test_routing_replay.py): the same
    gradient (float64, 1e-9), and not the one of the model's own routing (so the record is in force)."""
    cut = "K=2 on data 2 x fsdp 2 x expert 2"
    metrics, gradient = update(CUTS[cut], MESHES[cut], batch=replayed_batch())
    expected_metrics, expected = replayed_whole
    assert_same_update(metrics, gradient, expected_metrics, expected)
    router = lambda g: np.asarray(g["decoder"]["layers"]["router"])  # noqa: E731
    assert np.abs(router(expected) - router(whole[1])).max() > 1e-3 * np.abs(router(whole[1])).max()
    assert expected_metrics["actor/pg_loss"] != pytest.approx(whole[0]["actor/pg_loss"], rel=1e-6)


@pytest.fixture
def layer_inputs(monkeypatch):
    """The inputs of each call of the layer with experts (its hidden states, valid tokens and router weights), as
    the decoder hands them over: the written-out objectives below recompute the router's logits from them."""
    seen = []
    moe_mlp = decoder.moe_mlp

    def spied(x, valid, router, *rest, **options):
        seen.append((x, valid, router))
        return moe_mlp(x, valid, router, *rest, **options)

    monkeypatch.setattr(decoder, "moe_mlp", spied)
    return seen


def router_losses_written_out(seen: list, aux_coef: float = 0.3, z_coef: float = 0.05):
    """``aux_coef x`` transformers' load-balancing loss ``+ z_coef x`` the router's z-loss of the one layer with
    experts the last forward pass went through, over its valid tokens, from that layer's input."""
    config = moe_config()
    (x, valid, router), = seen  # one layer with experts
    valid = valid.reshape(-1).astype(bool)
    router_logits = x.reshape(-1, x.shape[-1]) @ router
    probs = jax.nn.softmax(router_logits, axis=-1)
    chosen = jax.lax.top_k(probs, config.num_experts_per_tok)[1]
    counts = jnp.zeros_like(probs).at[jnp.arange(len(probs))[:, None], chosen].set(1.0)
    pairs = jnp.sum(valid)  # (token, layer with experts) pairs: one layer
    fractions = jax.lax.stop_gradient(jnp.sum(jnp.where(valid[:, None], counts, 0.0), axis=0) / pairs)
    balance = config.num_experts * jnp.sum(fractions * jnp.sum(jnp.where(valid[:, None], probs, 0.0), axis=0) / pairs)
    z = jnp.sum(jnp.where(valid, jax.nn.logsumexp(router_logits, axis=-1) ** 2, 0.0)) / pairs
    return aux_coef * balance + z_coef * z


def assert_is_gradient_of(gradient: dict, objective, model_class=CausalLM):
    """``gradient`` equals ``jax.grad(objective)`` at the updates' initial weights (float64: 1e-9 relative), and
    the router's gradient is not zero (two zeros would agree)."""
    graphdef, params = nnx.split(create_model(model_class, moe_config(), None, seed=0), nnx.Param)
    expected = jax.grad(lambda p: objective(nnx.merge(graphdef, p)))(params)
    assert len(jax.tree.leaves(gradient)) == len(jax.tree.leaves(expected))
    for (path, leaf), other in zip(jax.tree_util.tree_leaves_with_path(gradient), jax.tree.leaves(expected)):
        np.testing.assert_allclose(leaf, np.asarray(other), rtol=1e-9, atol=1e-13, err_msg=jax.tree_util.keystr(path))
    router = np.asarray(gradient["decoder"]["layers"]["router"])
    assert np.abs(router).max() > 1e-6


def response_log_probs(model, batch):
    """``log p`` of each response token under ``model``, from one forward pass over the padded rows."""
    ids, positions, segments = padded_inputs(batch)
    p, length = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    log_probs = jax.nn.log_softmax(model(ids, positions, segments)[:, p - 1 : p - 1 + length], axis=-1)
    return jnp.take_along_axis(log_probs, ids[:, p : p + length, None], axis=-1)[..., 0]


def test_the_update_is_jax_grad_of_its_objective_written_out(whole, layer_inputs):
    """Every cut above is compared with the engine's own one-micro-batch update; this compares that update with
    ``jax.grad`` of the objective written out here, so that a mistake all cuts share cannot pass: PPO's dual-clip
    token-mean loss + 0.3 x transformers' load-balancing loss + 0.05 x the router's z-loss, from the log-probs of
    one padded forward pass and the router logits of the layer with experts recomputed from that layer's input
    (float64: 1e-9 relative)."""
    batch = ragged_batch(3)
    mask = jnp.asarray(batch.response_mask)
    old, advantages = jnp.asarray(batch.old_log_prob), jnp.asarray(batch.advantages)

    def objective(model):
        layer_inputs.clear()
        ratio = jnp.exp(response_log_probs(model, batch) - old)
        clipped = jnp.maximum(-advantages * ratio, -advantages * jnp.clip(ratio, 0.8, 1.2))
        per_token = jnp.where(advantages < 0, jnp.minimum(clipped, -advantages * 3.0), clipped)
        policy = jnp.sum(jnp.where(mask, per_token, 0.0)) / jnp.sum(mask)
        return policy + router_losses_written_out(layer_inputs)

    assert_is_gradient_of(whole[1], objective)


def test_sft_on_a_model_with_experts_adds_the_router_losses_whatever_the_cut(layer_inputs):
    """SFT's update of a model with experts, cut into 3 uneven micro-batches by a token budget, is ``jax.grad`` of
    the demonstration's token-mean ``-log p`` + 0.3 x the load-balancing loss + 0.05 x the z-loss of the whole
    batch, written out (float64: 1e-9), and reports them under sft/."""
    batch = ragged_batch(3)
    metrics, gradient = update(CUTS["K=3 uneven (token budget)"], batch=batch, role="sft")
    mask = jnp.asarray(batch.response_mask)

    def objective(model):
        layer_inputs.clear()
        nll = jnp.sum(jnp.where(mask, -response_log_probs(model, batch), 0.0)) / jnp.sum(mask)
        return nll + router_losses_written_out(layer_inputs)

    assert_is_gradient_of(gradient, objective)
    assert metrics["sft/router_aux_loss"] > 2.05 and metrics["sft/router_z_loss"] > 0
    assert 1.0 < metrics["sft/expert_load"] < 2.0


def test_a_critic_on_a_decoder_with_experts_adds_its_own_router_losses(layer_inputs):
    """A critic whose decoder has experts, cut into 3 uneven micro-batches by a token budget: its gradient is
    ``jax.grad`` of the clipped value loss (0.5 x token-mean of max((v - R)^2, (clip(v, v_old +- 0.2) - R)^2))
    + 0.1 x the load-balancing loss + 0.05 x the z-loss of its own routing, written out (float64: 1e-9); a
    critic.router_aux_loss_coef of 0.1 (not the model's 0.3) is the one in force."""
    batch = ragged_batch(3)
    metrics, gradient = update(CUTS["K=3 uneven (token budget)"], batch=batch, role="critic",
                               router_aux_loss_coef=0.1)
    mask = jnp.asarray(batch.response_mask)
    old, returns = jnp.asarray(batch.values), jnp.asarray(batch.returns)
    p, length = batch.prompt_ids.shape[1], batch.response_ids.shape[1]

    def objective(model):
        layer_inputs.clear()
        values = model(*padded_inputs(batch))[:, p - 1 : p - 1 + length]  # the state before each response token
        error = jnp.maximum((values - returns) ** 2, (jnp.clip(values, old - 0.2, old + 0.2) - returns) ** 2)
        return 0.5 * jnp.sum(jnp.where(mask, error, 0.0)) / jnp.sum(mask) + router_losses_written_out(
            layer_inputs, aux_coef=0.1)

    assert_is_gradient_of(gradient, objective, ValueModel)
    assert metrics["critic/router_aux_loss"] > 2.0 and metrics["critic/router_z_loss"] > 0
