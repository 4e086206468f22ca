"""LoRA adapters (``actor.lora`` / ``critic.lora``): zero adapters are the base model, only adapters train (their
gradient independent of the cut and the mesh), the reference is the frozen base read in place, checkpoints hold
the adapters and resume exactly, and the export writes merged weights or a PEFT adapter that ``peft`` loads."""

from __future__ import annotations

import json
import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_cases import ragged_batch, reference_actor_loss, reference_critic_loss, tiny_config
from flax import nnx
from jax.sharding import PartitionSpec as P

from jppo.config import ConfigError, check_mesh, load_config, views
from jppo.core.settings import LoRAConfig, OptimConfig
from jppo.engine import (
    ActorConfig,
    CriticConfig,
    UpdateStep,
    actor_loss_fn,
    critic_loss_fn,
    init_train_state,
    run_updates,
)
from jppo.models import CausalLM, ModelConfig, ValueModel, create_model, token_log_probs
from jppo.models.lora import attach_lora, merged, save_peft_adapter
from jppo.models.sharding import variable_spec
from jppo.parallel.mesh import batch_shards, make_mesh
from jppo.run import build
from jppo.run.loop import run

ROOT = pathlib.Path(__file__).resolve().parents[1]
QUICKSTART_LORA = ROOT / "configs" / "quickstart_lora.yaml"
N, C = 16, 6.0
LORA = LoRAConfig(rank=2, alpha=4.0)


def qwen2_config(dtype: str = "float32") -> ModelConfig:
    return ModelConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                       model_type="qwen2", dtype=dtype, param_dtype=dtype)


def randomize_adapters(model: nnx.Module, seed: int = 7) -> None:
    """Non-zero B (A is already random), so the adapted model differs from its base and A gets a gradient."""
    lora = nnx.state(model, nnx.LoRAParam)
    keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(lora))))
    nnx.update(model, jax.tree.map(lambda x: x + 0.3 * jax.random.normal(next(keys), x.shape, x.dtype), lora))


def test_zero_initialised_adapters_reproduce_the_base_log_probs_exactly():
    model = create_model(CausalLM, qwen2_config(), seed=0)
    ids = jax.random.randint(jax.random.key(1), (3, 9), 0, 40)
    targets = jnp.roll(ids, -1, axis=1)
    base, _ = token_log_probs(model, ids, None, None, targets)
    attach_lora(model, LORA, seed=1)
    adapted, _ = token_log_probs(model, ids, None, None, targets)
    np.testing.assert_array_equal(np.asarray(adapted), np.asarray(base))
    randomize_adapters(model)
    changed, _ = token_log_probs(model, ids, None, None, targets)
    assert np.abs(np.asarray(changed) - np.asarray(base)).max() > 1e-3  # the adapters are in the forward pass


def lora_engine_step(role: str, mesh_shape, cut: dict):
    """The accumulated gradient, the state before and after one LoRA update of the whole ragged batch."""
    mesh = make_mesh(*mesh_shape, devices=jax.devices()[: int(np.prod(mesh_shape))])
    shards = batch_shards(mesh)
    if "ppo_micro_batch_size" in cut:
        cut = dict(ppo_micro_batch_size=max(1, cut["ppo_micro_batch_size"] // shards))
    common = dict(ppo_mini_batch_size=N, shuffle=False, optim=OptimConfig(name="sgd", lr=0.5, grad_clip=0.0),
                  loss_agg_mode="token-mean", loss_scale_factor=C, **cut)
    if role == "actor":
        cfg = ActorConfig(**common, entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1)
        model_cls, loss = CausalLM, actor_loss_fn(cfg)
    else:
        cfg = CriticConfig(**common, cliprange_value=0.3)
        model_cls, loss = ValueModel, critic_loss_fn(cfg)
    model = create_model(model_cls, tiny_config(), mesh, seed=0)
    attach_lora(model, LORA, seed=1)
    randomize_adapters(model)
    graphdef, params, frozen = build.split_trained(model)
    state = init_train_state(params, cfg, mesh, keep_gradient=True, frozen=frozen)
    before = jax.device_get(state)
    step = UpdateStep(graphdef, loss, cfg, mesh, role, keep_gradient=True)
    new, _, gradients = run_updates(step, state, ragged_batch(0), cfg, mesh, np.random.default_rng(0))
    return cfg, graphdef, before, state, new, jax.tree.map(lambda g: g[0], jax.device_get(gradients))


CASES = [((1, 1, 1), {"ppo_micro_batch_size": 16}), ((1, 1, 1), {"ppo_micro_batch_size": 4}),
         ((4, 2, 1), {"ppo_micro_batch_size": 8}), ((2, 2, 2), {"use_dynamic_bsz": True, "ppo_max_token_len": 18})]


@pytest.mark.parametrize("mesh_shape,cut", CASES, ids=["K1", "K4", "mesh4x2x1-K2", "mesh2x2x2-token-budget"])
@pytest.mark.parametrize("role", ["actor", "critic"])
def test_only_adapters_train_and_their_gradient_is_the_whole_batch_gradient_on_any_cut(role, mesh_shape, cut):
    with jax.enable_x64(True):
        cfg, graphdef, before, state, new, gradient = lora_engine_step(role, mesh_shape, cut)
        trained = {path for path, _ in nnx.to_flat_state(before.params)}
        assert all("lora" in path or (role == "critic" and "value_head" in path) for path in trained)
        assert any("value_head" in path for path in trained) == (role == "critic")
        # optimizer state and gradient accumulator hold the adapters only
        assert {path for path, _ in nnx.to_flat_state(gradient)} == trained
        if cut.get("ppo_micro_batch_size") == 16:  # K = 1: no accumulator at all
            assert new.opt_state.acc_grads is None
        else:
            sizes = sum(x.size for x in jax.tree.leaves(new.opt_state.acc_grads))
            assert sizes == sum(x.size for x in jax.tree.leaves(before.params))
        # the frozen base is passed through untouched, as the very same arrays (the reference reads them)
        for kept, original in zip(jax.tree.leaves(new.frozen), jax.tree.leaves(state.frozen)):
            assert kept is original
        chex.assert_trees_all_equal(jax.device_get(new.frozen), before.frozen)
        # the gradient w.r.t. the adapters of the whole-batch loss, without the engine
        loss = reference_actor_loss if role == "actor" else reference_critic_loss
        expected = jax.grad(lambda p: loss(nnx.merge(graphdef, before.frozen, p), ragged_batch(0), cfg, C)[0])(
            before.params
        )
        chex.assert_trees_all_close(gradient, expected, rtol=1e-9, atol=1e-12)


def test_adapters_are_sharded_by_the_rule_table():
    mesh = make_mesh(1, 2, 2, devices=jax.devices()[:4])
    model = create_model(CausalLM, qwen2_config(), mesh, seed=0)
    attach_lora(model, LORA, seed=1)
    lora = model.decoder.layers.lora
    assert lora.q_proj_a[...].sharding.spec == variable_spec(lora.q_proj_a, mesh) == P(None, "fsdp", None)
    assert lora.down_proj_a[...].sharding.spec == P(None, "tensor", None)
    assert lora.q_proj_b[...].sharding.spec == P(None, None, "tensor")


def test_merged_weights_compute_what_the_adapted_model_computes():
    model = create_model(CausalLM, qwen2_config(), seed=0)
    attach_lora(model, LoRAConfig(rank=3, alpha=5.0, target_modules=["v_proj", "up_proj"]), seed=1)
    randomize_adapters(model)
    ids = jax.random.randint(jax.random.key(2), (2, 7), 0, 40)
    plain = merged(model)
    assert plain.decoder.layers.lora is None
    np.testing.assert_allclose(np.asarray(plain(ids)), np.asarray(model(ids)), rtol=1e-5, atol=1e-5)


def test_peft_loads_the_exported_adapter_and_transformers_the_merged_weights(tmp_path):
    import torch  # noqa: PLC0415 (the test extra installs it: a missing torch fails, never skips)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from jppo.models import save_pretrained

    model = create_model(CausalLM, qwen2_config(), seed=0)
    save_pretrained(model, tmp_path / "base")
    lora = LoRAConfig(rank=4, alpha=8.0, target_modules=["q_proj", "k_proj", "o_proj", "gate_proj", "down_proj"])
    attach_lora(model, lora, seed=1)
    randomize_adapters(model)
    save_peft_adapter(model.decoder.layers.lora, lora, tmp_path / "adapter", base_model=str(tmp_path / "base"))
    save_pretrained(merged(model), tmp_path / "merged")
    ids = np.asarray(jax.random.randint(jax.random.key(3), (2, 8), 0, 40))
    expected = np.asarray(model(jnp.asarray(ids)))

    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", torch_dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        np.testing.assert_allclose(peft_model(torch.from_numpy(ids)).logits.numpy(), expected, rtol=1e-4, atol=1e-4)
        plain = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", torch_dtype=torch.float32).eval()
        np.testing.assert_allclose(plain(torch.from_numpy(ids)).logits.numpy(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "override,key",
    [("actor.lora.rank=-1", "actor.lora.rank=-1"), ("critic.lora.alpha=0", "critic.lora.alpha=0"),
     ("actor.lora.target_modules=[q_proj,qkv]", "actor.lora.target_modules="),
     ("actor.lora.target_modules=[]", "actor.lora.target_modules="),
     ("actor.lora.dropout=0.1", "actor.lora.dropout=0.1"),
     ("actor.lora.rank=65", "actor.lora.rank=65"),  # wider than the 64-wide model: not low-rank
     ("model.initializer_range=0", "model.initializer_range=0")],
)
def test_bad_lora_settings_are_one_line_config_errors(override, key):
    with pytest.raises(ConfigError) as error:
        load_config(QUICKSTART_LORA, [override])
    message = str(error.value)
    assert "\n" not in message and message.startswith(key), message


SMALL = ["data.train_batch_size=16", "actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=8",
         "actor.ppo_micro_batch_size=2", "critic.ppo_micro_batch_size=2", "trainer.val_every=0",
         "trainer.plots=false", "trainer.logger=[jsonl]", "trainer.progress_bar=false",
         "actor.use_kl_loss=true", "actor.kl_loss_coef=0.1", "critic.lora.rank=4"]


def train(out: pathlib.Path, devices: int, *overrides: str) -> list[dict]:
    cfg = load_config(QUICKSTART_LORA, [*SMALL, f"trainer.output_dir={out}", "mesh.data=1", *overrides])
    run(cfg, check_mesh(cfg, devices), build.load_inputs(cfg), devices=jax.devices()[:devices])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith(("timing/", "perf/"))} for row in rows]


def test_the_reference_is_the_frozen_base_read_in_place(tmp_path):
    from jppo.run.collect import collect
    from jppo.run.learn import learn
    from jppo.run.loop import setup
    from jppo.runlog.timing import PhaseTimer

    cfg = load_config(QUICKSTART_LORA, [*SMALL, f"trainer.output_dir={tmp_path}", "mesh.data=2"])
    mesh = make_mesh(2, 1, 1, devices=jax.devices()[:2])
    state, collector, learner, _ = setup(cfg, mesh, build.load_inputs(cfg))
    assert collector.ref_params is None  # no copy of the policy: the reference reads the actor's frozen base
    base = state.actor.frozen
    state, exp, _ = collect(collector, state, PhaseTimer())
    np.testing.assert_array_equal(exp.ref_log_prob, exp.old_log_prob)  # zero adapters: policy == reference
    state, _ = learn(learner, state, exp, PhaseTimer())
    assert all(a is b for a, b in zip(jax.tree.leaves(state.actor.frozen), jax.tree.leaves(base)))
    _, exp, _ = collect(collector, state, PhaseTimer())
    assert np.abs(exp.ref_log_prob - exp.old_log_prob).max() > 0


def test_lora_runs_do_not_depend_on_the_mesh_or_the_cut_and_resume_exactly(lora_run, tmp_path):
    straight = train(tmp_path / "straight", 1, "trainer.total_steps=2")
    assert straight[1]["actor/kl_loss"] > 0.0  # the reference stays the base while the adapters move away from it
    assert straight[1]["rollout/log_prob_abs_diff"] < 1e-4  # the sampler runs the adapters as the trainer does
    other = train(tmp_path / "other", 4, "trainer.total_steps=2", "mesh.data=2", "mesh.fsdp=2",
                  "actor.ppo_micro_batch_size=1", "critic.use_dynamic_bsz=true", "critic.ppo_max_token_len=16")
    for a, b in zip(other, straight):
        assert set(a) == set(b)
        for name, value in b.items():
            np.testing.assert_allclose(a[name], value, rtol=1e-4, atol=1e-6, err_msg=name)
    import shutil

    # lora_run is the first step of this run, saved (trainer.seed 0 is the config's): one training run fewer
    shutil.copytree(lora_run, tmp_path / "resumed")
    resumed = train(tmp_path / "resumed", 1, "trainer.total_steps=2")
    assert resumed[1] == straight[1]

    # the checkpoint holds the adapters (and the critic's head), never the base weights
    import orbax.checkpoint as ocp

    tree = ocp.PyTreeCheckpointer().metadata(tmp_path / "resumed" / "checkpoints" / "2" / "state").item_metadata

    def names(subtree) -> set[str]:
        return {"/".join(str(getattr(key, "key", key)) for key in path)
                for path, _ in jax.tree_util.tree_flatten_with_path(subtree)[0]}

    actor, critic = names(tree["actor"]["params"]), names(tree["critic"]["params"])
    assert actor and all("/lora/" in name for name in actor), actor
    assert any("value_head" in name for name in critic)
    assert all("/lora/" in name or "value_head" in name for name in critic), critic
    assert "frozen" not in tree["actor"] or not names(tree["actor"]["frozen"])

    # the export CLI: merged weights (as the run's policy computes) or the adapter alone
    from jppo.export import main
    from jppo.run.export import restore_policy, run_config

    run_dir = tmp_path / "resumed"
    assert main([str(run_dir), str(tmp_path / "hf")]) == 0
    assert main([str(run_dir), str(tmp_path / "adapter"), "--adapters"]) == 0
    assert {p.name for p in (tmp_path / "adapter").iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    from etils import epath

    from jppo.data import load_tokenizer
    from jppo.models import load_pretrained

    checkpoint = epath.Path(run_dir / "checkpoints" / "2")
    cfg = run_config(checkpoint)
    policy = restore_policy(checkpoint, cfg, load_tokenizer(views.tokenizer_spec(cfg)))
    ids = jnp.asarray([[1, 2, 3, 4, 5, 6]])
    exported = load_pretrained(tmp_path / "hf")
    np.testing.assert_allclose(np.asarray(exported(ids)), np.asarray(policy(ids)), rtol=1e-5, atol=1e-5)
    adapter = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 8 and adapter["lora_alpha"] == 16


def test_the_memory_plan_counts_only_the_adapters_in_the_optimizer_and_no_reference_copy():
    from jppo.preflight.memory import memory_plan

    overrides = ["actor.use_kl_loss=true", "mesh.data=1"]
    cfg = load_config(QUICKSTART_LORA, overrides)
    full = memory_plan(load_config(QUICKSTART_LORA, [*overrides, "actor.lora.rank=0"]), (1, 1, 1))
    plan = memory_plan(cfg, (1, 1, 1))
    model = create_model(CausalLM, views.random_model_config(cfg, build.load_inputs(cfg).tokenizer), seed=0)
    base = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    attach_lora(model, cfg.actor.lora, seed=1)
    adapters = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))
    assert plan.term("optimizer_state/actor") == adapters * 4 * 3  # AdamW's two moments and the accumulator, float32
    assert plan.term("gradients/actor") == adapters * 4
    assert plan.term("parameters/actor") == (base + adapters) * 4
    assert full.term("parameters/reference") == base * 4 and plan.term("parameters/reference") == 0
    assert plan.peak_bytes < full.peak_bytes


# --- a checkpoint's models are rebuilt as it records them (issue 25, items 1 and 6) ---
# the CLI sees the 8 test devices
# greedy validation (rollout.val_temperature 0)
EVAL = ["data.num_val_examples=8", "data.val_batch_size=8", "mesh.data=-1", "actor.ppo_micro_batch_size=1",
        "critic.ppo_micro_batch_size=1"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> pathlib.Path:
    """One training step of the LoRA quickstart (LoRA actor and critic, random base from trainer.seed 0), saved."""
    out = tmp_path_factory.mktemp("lora_run")
    train(out, 1, "trainer.total_steps=1", "trainer.save_every=1", "trainer.seed=0")
    return out


def evaluate_with(run_dir: pathlib.Path, out: pathlib.Path, *overrides: str) -> list[dict]:
    from jppo.eval import main

    assert main(["--config", str(QUICKSTART_LORA), "--out", str(out), *SMALL, *EVAL, f"trainer.output_dir={run_dir}",
                 f"trainer.resume={run_dir}", *overrides]) == 0
    return [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]


def test_a_lora_checkpoint_evaluates_and_exports_the_trained_policy_whatever_trainer_seed_says(lora_run, tmp_path):
    from etils import epath

    from jppo.data import load_tokenizer
    from jppo.run.export import restore_policy

    checkpoint = lora_run / "checkpoints" / "1"
    seed0 = evaluate_with(lora_run, tmp_path / "seed0", "trainer.seed=0")
    seed1 = evaluate_with(lora_run, tmp_path / "seed1", "trainer.seed=1")
    assert seed1 == seed0  # the base drawn from the checkpoint's seed: the same greedy responses and rewards

    # the run's config.yaml after a resume with another seed: the export still rebuilds the base from seed 0
    cfg = load_config(QUICKSTART_LORA, [*SMALL, f"trainer.output_dir={lora_run}", "mesh.data=1", "trainer.seed=5"])
    policy = restore_policy(epath.Path(checkpoint), cfg, load_tokenizer(views.tokenizer_spec(cfg)))
    drawn = create_model(CausalLM, views.random_model_config(cfg, load_tokenizer(views.tokenizer_spec(cfg))), seed=0)
    got = dict(nnx.to_flat_state(nnx.state(policy, nnx.Param)))
    for path, want in nnx.to_flat_state(nnx.state(drawn, nnx.Param)):  # every base weight: seed 0's, not seed 5's
        np.testing.assert_array_equal(np.asarray(got[path][...]), np.asarray(want[...]), err_msg=str(path))


def test_the_lora_quickstart_exports_its_random_base_and_peft_loads_its_adapters_onto_it(lora_run, tmp_path):
    """docs/lora.md's two exports of a run whose base was drawn at random: ``--base`` (the frozen weights alone, a
    plain Hugging Face model) and ``--adapters``; PEFT's model of the two computes the trained policy."""
    import torch  # noqa: PLC0415 (the test extra installs it: a missing torch fails, never skips)
    from etils import epath
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from jppo.data import load_tokenizer
    from jppo.export import main
    from jppo.run.export import find_checkpoint, restore_policy, run_config

    assert main([str(lora_run), str(tmp_path / "base"), "--base"]) == 0
    assert main([str(lora_run), str(tmp_path / "adapters"), "--adapters"]) == 0
    checkpoint = find_checkpoint(epath.Path(lora_run), None)
    cfg = run_config(checkpoint)
    policy = restore_policy(checkpoint, cfg, load_tokenizer(views.tokenizer_spec(cfg)))
    ids = np.asarray([[1, 5, 2, 7, 3, 11, 4, 9]])
    expected = np.asarray(policy(jnp.asarray(ids)))
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()
    with torch.no_grad():
        alone = base(torch.from_numpy(ids)).logits.numpy()
        adapted = PeftModel.from_pretrained(base, tmp_path / "adapters").eval()(torch.from_numpy(ids)).logits.numpy()
    # float32 on both sides, 2 layers: the 1e-4 of the merged-weights test above
    np.testing.assert_allclose(adapted, expected, rtol=1e-4, atol=1e-4)
    assert np.abs(alone - expected).max() > 1e-3  # the step moved the adapters: the base alone is not the policy


def test_a_resume_with_another_seed_keeps_the_checkpoints_base(lora_run, tmp_path):
    import shutil

    resumed = tmp_path / "resumed"
    shutil.copytree(lora_run, resumed)
    train(resumed, 1, "trainer.total_steps=2", "trainer.seed=1")
    assert evaluate_with(resumed, tmp_path / "seed1", "trainer.seed=1") == evaluate_with(
        resumed, tmp_path / "seed0", "trainer.seed=0")
    from jppo.run.checkpoint import read_meta

    models = read_meta(resumed / "checkpoints" / "2")["models"]
    assert models["trainer.seed"] == 0  # drawn from seed 0 at step 0: step 2's adapters sit on that base


def test_a_checkpoint_written_before_the_record_rebuilds_its_base_from_the_config_it_saved(lora_run, tmp_path):
    import shutil

    old = tmp_path / "old"
    shutil.copytree(lora_run, old)
    file = old / "checkpoints" / "1" / "meta" / "metadata"  # orbax's JsonSave file
    meta = json.loads(file.read_text())
    del meta["models"]  # the meta as jppo wrote it before it recorded the models
    file.write_text(json.dumps(meta))
    from jppo.run.checkpoint import read_meta

    assert "models" not in read_meta(old / "checkpoints" / "1")
    seed0 = evaluate_with(old, tmp_path / "seed0", "trainer.seed=0")
    assert evaluate_with(old, tmp_path / "seed1", "trainer.seed=1") == seed0


@pytest.mark.parametrize("override, key", [
    ("actor.lora.rank=4", "actor.lora.rank"),
    ("actor.lora.rank=0", "actor.lora.rank"),  # LoRA off: the checkpoint holds adapters, not the full weights
    ("critic.lora.rank=0", "critic.lora.rank"),
    ("actor.lora.target_modules=[q_proj]", "actor.lora.target_modules"),
    ("model.hidden_size=32", "model.hidden_size"),
    ("algorithm.adv_estimator=reinforce_plus_plus", "critic.enable"),  # a critic-free run of a checkpoint with one
])
def test_a_checkpoint_of_other_models_than_the_config_is_refused_in_one_line(lora_run, tmp_path, capsys, override,
                                                                             key):
    from jppo.eval import main

    code = main(["--config", str(QUICKSTART_LORA), "--out", str(tmp_path), *SMALL, *EVAL,
                 f"trainer.output_dir={lora_run}", f"trainer.resume={lora_run}", override])
    error = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in error, error
    assert error.startswith("jppo.eval: error: trainer.resume: checkpoint ") and f"with {key}=" in error, error
    assert f"this config has {key}=" in error, error


def test_a_lora_rank_too_large_for_a_model_path_checkpoint_names_the_key(tmp_path):
    config = qwen2_config()  # narrowest projection side: the 16-wide k/v projections (2 kv heads x 8)
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "vocab_size": 40, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2,
    }))
    assert config.kv_size == 16
    for section in ("actor", "critic"):
        with pytest.raises(ConfigError) as error:
            load_config(QUICKSTART_LORA, [f"model.path={tmp_path}", f"{section}.lora.rank=17"])
        assert str(error.value) == (f"{section}.lora.rank=17 is invalid: it must be <= 16 "
                                    "(the narrowest side of a target projection)")
    load_config(QUICKSTART_LORA, [f"model.path={tmp_path}", "actor.lora.rank=16", "critic.lora.rank=16"])


def test_a_lora_base_loaded_from_model_path_is_checked_by_its_checksum(tmp_path, capsys):
    import shutil

    from jppo.data import load_tokenizer
    from jppo.eval import main
    from jppo.models import save_pretrained

    cfg = load_config(QUICKSTART_LORA, ["mesh.data=1"])
    shape = views.random_model_config(cfg, load_tokenizer(views.tokenizer_spec(cfg)))
    base, other, moved = tmp_path / "base", tmp_path / "other", tmp_path / "moved"
    save_pretrained(create_model(CausalLM, shape, seed=3), base)
    save_pretrained(create_model(CausalLM, shape, seed=4), other)  # the same shape, other weights
    source = ["model.tokenizer=builtin:reverse_digits"]
    train(tmp_path / "run", 1, "trainer.total_steps=1", "trainer.save_every=1", f"model.path={base}", *source)
    shutil.copytree(base, moved)

    def evaluate(path: pathlib.Path) -> int:
        return main(["--config", str(QUICKSTART_LORA), "--out", str(tmp_path / "eval"), *SMALL, *EVAL, *source,
                     f"trainer.output_dir={tmp_path / 'run'}", f"trainer.resume={tmp_path / 'run'}",
                     f"model.path={path}"])

    assert evaluate(moved) == 0  # the same weights elsewhere: the same base
    capsys.readouterr()
    assert evaluate(other) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "actor.lora adapters were trained on a frozen base loaded from" in error, error
    assert f"this config's model.path loads {str(other)!r}" in error, error
