"""Context parallelism (``mesh.sequence``): the tokens of each packed row split over devices give the one-device
log-probs, gradients and counts (docs/contract.md#every-new-axis-is-a-batch-axis).

Float64 throughout, so the only differences are summation order (the all-gather's transpose sums the key and value
gradients of a row's shards; XLA sums partial products in another order): rtol 1e-9, as the engine's own tests.
"""

from __future__ import annotations

import dataclasses
import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_cases import mesh_of, ragged_batch, reference_step, tiny_config
from flax import nnx

from jppo import plan
from jppo.config import ConfigError, check_mesh, load_config
from jppo.core.metrics import finish
from jppo.core.settings import OptimConfig
from jppo.engine import (
    ActorConfig,
    CriticConfig,
    UpdateStep,
    actor_loss_fn,
    critic_loss_fn,
    init_train_state,
    mini_batch_norm_stats,
    run_updates,
)
from jppo.engine.layout import next_token_targets, place
from jppo.models import context
from jppo.models.decoder import CausalLM
from jppo.models.log_probs import token_log_probs
from jppo.models.sharding import create_model
from jppo.models.value import ValueModel
from jppo.preflight import footprint, memory

QUICKSTART = pathlib.Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
SGD = OptimConfig(name="sgd", lr=0.5, grad_clip=0.0)
C = 8.0  # loss_scale_factor: the response width


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


@pytest.fixture
def traced(monkeypatch):
    """Counts the traces of the context-parallel attention: a test on a sequence mesh must have run it."""
    calls = []
    attention = context.sequence_attention

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return attention(*args, **kwargs)

    monkeypatch.setattr("jppo.models.decoder.sequence_attention", counted)
    return calls


def packed_rows(seed: int = 0):
    """Two rows of 24 tokens: row 0 packs a 7-token and a 9-token sequence, then 8 of padding; row 1 is one
    sequence across the whole row (every shard boundary inside it). Positions restart at each sequence."""
    rng = np.random.default_rng(seed)
    segments = np.array([[1] * 7 + [2] * 9 + [0] * 8, [1] * 24], np.int32)
    positions = np.zeros_like(segments)
    for row in range(2):
        for segment in (1, 2):
            where = segments[row] == segment
            positions[row, where] = np.arange(where.sum())
    ids = np.where(segments > 0, rng.integers(1, 48, segments.shape), 0).astype(np.int32)
    weights = rng.standard_normal((2, *segments.shape)) * (segments > 0)
    return ids, positions, segments, weights


def log_prob_value_and_grad(mesh, **attention):
    """``sum(w1 log_prob + w2 entropy)`` over the packed rows, with its gradient, on ``mesh`` (5-position chunks:
    a shard's block of 12 or 6 tokens is not a multiple of the chunk); ``attention``: ModelConfig's attention
    keys."""
    ids, positions, segments, weights = packed_rows()
    config = dataclasses.replace(tiny_config(), **attention)
    graphdef, params = nnx.split(create_model(CausalLM, config, mesh, seed=0), nnx.Param)

    def loss(params):
        model = nnx.merge(graphdef, params)
        log_probs, entropy = token_log_probs(model, ids, positions, segments, next_token_targets(jnp.asarray(ids)),
                                             chunk_size=5, with_entropy=True)
        return jnp.sum(weights[0] * log_probs + weights[1] * entropy), (log_probs, entropy)

    with jax.set_mesh(mesh):
        return jax.device_get(jax.jit(jax.value_and_grad(loss, has_aux=True))(params))


@pytest.fixture(scope="module")
def one_device():
    with jax.enable_x64(True):
        return log_prob_value_and_grad(mesh_of((1, 1, 1, 1)))


# heads split over tensor in the second; the third: blockwise attention on each shard's slice of the rows (blocks
# of 8 queries and 8 keys: a shard's 12 queries, 2 blocks of them, against 24 keys, some pairs invisible, skipped)
@pytest.mark.parametrize("shape, attention", [
    ((2, 1, 1, 4), {}), ((1, 1, 2, 2), {}),
    ((1, 1, 1, 2), dict(attention="blockwise", attention_block_q=8, attention_block_kv=8)),
])
def test_packed_rows_split_over_the_sequence_axis_give_the_one_device_log_probs_and_gradients(
    shape, attention, one_device, traced
):
    (value, (log_probs, entropy)), grads = log_prob_value_and_grad(mesh_of(shape), **attention)
    assert traced and all(q[1] == 24 for q in traced)  # the queries' global shape; each shard holds 24 / sequence
    (ref_value, (ref_log_probs, ref_entropy)), ref_grads = one_device
    valid = packed_rows()[2] > 0
    np.testing.assert_allclose(log_probs[valid], ref_log_probs[valid], rtol=1e-9)
    np.testing.assert_allclose(entropy[valid], ref_entropy[valid], rtol=1e-9)
    np.testing.assert_allclose(value, ref_value, rtol=1e-9)
    chex.assert_trees_all_close(grads, ref_grads, rtol=1e-9, atol=1e-14)


def update_cfg(role: str, **kw):
    if role == "actor":
        return ActorConfig(ppo_mini_batch_size=16, shuffle=False, optim=SGD, entropy_coeff=0.01, use_kl_loss=True,
                           kl_loss_coef=0.1, loss_scale_factor=C, **kw)
    return CriticConfig(ppo_mini_batch_size=16, shuffle=False, optim=SGD, cliprange_value=0.3, loss_scale_factor=C,
                        **kw)


# (role, mesh, cut): sequence 2 and 4 (beside data); fixed rows of 4 + 8 tokens and a 20-token budget, both
# splitting into equal blocks; a sequence-mean mode (S counted over the row's shards) and token-mean
CASES = [
    ("actor", (1, 1, 1, 2), dict(ppo_micro_batch_size=8, loss_agg_mode="seq-mean-token-mean")),
    ("critic", (2, 1, 1, 4), dict(use_dynamic_bsz=True, ppo_max_token_len=20, loss_agg_mode="token-mean")),
]


@pytest.mark.parametrize("role,shape,cut", CASES, ids=[f"{r}-{s}" for r, s, _ in CASES])
def test_a_mini_batch_gradient_on_the_sequence_axis_equals_the_whole_batch_one(role, shape, cut, traced):
    mesh = mesh_of(shape)
    batch = ragged_batch(0, p=4, length=8)
    cfg = update_cfg(role, **cut)
    model_cls = CausalLM if role == "actor" else ValueModel
    graphdef, params = nnx.split(create_model(model_cls, tiny_config(), mesh, seed=0), nnx.Param)
    loss = actor_loss_fn(cfg) if role == "actor" else critic_loss_fn(cfg)
    state = init_train_state(params, cfg, mesh, keep_gradient=True)
    step = UpdateStep(graphdef, loss, cfg, mesh, role, keep_gradient=True)
    state, metrics, gradients = run_updates(step, state, batch, cfg, mesh, np.random.default_rng(0))
    assert traced
    _, ref_grads, _, ref_metrics = reference_step(create_model(model_cls, tiny_config(), None, seed=0), batch, cfg, C)
    chex.assert_trees_all_close(jax.tree.map(lambda g: g[0], jax.device_get(gradients)), jax.device_get(ref_grads),
                                rtol=1e-9)
    for name, value in finish(ref_metrics).items():
        np.testing.assert_allclose(metrics[name], float(value), rtol=1e-9, atol=1e-12, err_msg=name)


def test_norm_stats_count_a_row_split_over_the_sequence_axis_once():
    """N and S of a mask whose rows' tokens sit on one shard of the row, on several, or on none."""
    mesh = mesh_of((2, 1, 1, 4))
    mask = np.zeros((1, 2, 3, 8), bool)  # [K, D, S, L]: 8 slots over 4 shards of 2
    mask[0, 0, 0, 6:] = True  # the last shard only
    mask[0, 0, 1, :] = True  # every shard
    mask[0, 1, 0, 1] = True  # one token on the first shard
    mask[0, 1, 2, [0, 7]] = True  # the first and last shards; row (1, 1) and (0, 2) are empty
    with jax.set_mesh(mesh):
        stats = jax.jit(lambda m: mini_batch_norm_stats(m, C, mesh))(place(mask, mesh))
    assert float(stats.num_tokens) == 2 + 8 + 1 + 2
    assert float(stats.num_seqs) == 4


@pytest.mark.parametrize(
    "overrides,devices,message",
    [
        (["mesh.sequence=3"], 8, "mesh.sequence=3 does not divide the 8 devices"),
        (["mesh.sequence=2"], 8,
         "mesh.sequence=2 must divide rollout.prompt_bucket=8 and rollout.max_response_length=5"),
        (["mesh.sequence=4", "rollout.max_response_length=8", "actor.use_dynamic_bsz=true",
          "actor.ppo_max_token_len=18"], 8, "mesh.sequence=4 must divide actor.ppo_max_token_len=18"),
    ],
)
def test_a_sequence_axis_that_does_not_split_the_devices_or_the_rows_is_one_line(overrides, devices, message):
    with pytest.raises(ConfigError) as error:
        check_mesh(load_config(QUICKSTART, ["mesh.data=-1", *overrides]), devices)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("name,roles", [("qwen2_5_0_5b_gsm8k_grpo.yaml", ("actor",)),
                                        ("qwen2_5_0_5b_gsm8k_ppo.yaml", ("actor", "critic"))])
@pytest.mark.parametrize("devices,sequence,budget", [(1, 1, 4096), (2, 2, 8192)])
def test_a_sequence_axis_too_large_for_the_devices_says_what_to_set_and_that_runs(
        tmp_path, name, roles, devices, sequence, budget):
    """The GSM8K configs with their rows split over mesh.sequence=4 (16384 tokens, 4096 a device): on 1 or 2 devices
    the one-line error names the overrides that keep each device's 4096 tokens, and the config with them passes the
    same check."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    (tmp_path / "rows.jsonl").write_text('{"prompt": "1+1?", "answer": "#### 2"}\n')
    paths = [f"model.path={tmp_path / 'ckpt'}", f"data.train_files={tmp_path / 'rows.jsonl'}",
             f"data.val_files={tmp_path / 'rows.jsonl'}", "mesh.sequence=4",
             *(f"{role}.ppo_max_token_len=16384" for role in roles)]
    config = QUICKSTART.parent / name
    with pytest.raises(ConfigError) as error:
        check_mesh(load_config(config, paths), devices)
    fitting = [f"mesh.sequence={sequence}", *(f"{role}.ppo_max_token_len={budget}" for role in roles)]
    assert str(error.value) == (f"mesh.sequence=4 does not divide the {devices} devices; on {devices} device(s) set "
                                f"{' '.join(fitting)} (the same 4096 tokens per device)")
    assert check_mesh(load_config(config, [*paths, *fitting]), devices)[3] == sequence


def test_the_command_refuses_a_sequence_axis_in_one_line_with_exit_status_2(capsys):
    assert plan.main(["--config", str(QUICKSTART), "--devices", "8", "mesh.sequence=2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "mesh.sequence=2 must divide rollout.prompt_bucket=8" in err, err


def test_the_plan_splits_a_row_s_activations_and_logits_over_the_sequence_axis():
    """On 2 devices a 16-token row's tokens go to both (sequence=2) or its row to one (data=2, the other device
    idle): half the tokens per device, each still attending over the whole row, plus the gathered keys and values."""
    budget = ["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len=16", "critic.use_dynamic_bsz=true",
              "critic.ppo_max_token_len=16", "actor.log_prob_chunk_size=64", "model.remat=false", "mesh.data=1"]
    whole, split = (memory.memory_plan(cfg, check_mesh(cfg, 2)) for cfg in (
        load_config(QUICKSTART, [*budget, "mesh.fsdp=2"]), load_config(QUICKSTART, [*budget, "mesh.sequence=2"])))
    assert split.mesh["sequence"] == 2 and whole.mesh["sequence"] == 1
    assert split.term("logits/actor") * 2 == whole.term("logits/actor")  # chunk of 16 -> 8 positions
    m = footprint.model_config(load_config(QUICKSTART, budget))
    kv = m.num_kv_heads * m.head_dim * jnp.dtype(m.dtype).itemsize  # keys or values of one token
    gathered = 8 * 2 * kv * m.num_layers  # 8 local tokens, the other shard's keys and values, every layer
    assert split.term("activations/actor") * 2 == whole.term("activations/actor") + 2 * gathered
