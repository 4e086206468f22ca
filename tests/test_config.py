"""The trainer's config: schema defaults, YAML + overrides, and one-line errors naming key and value."""

import dataclasses
import json
import pathlib
import re
import sys
import types
import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jppo.config import RANDOM_MODEL, ActorSection, ConfigError, ModelSection, load_config, save_config
from jppo.config.devices import check_mesh
from jppo.config.views import engine_view
from jppo.engine import ActorConfig, CriticConfig
from jppo.engine.driver import mini_batches
from jppo.engine.optim import learning_rate_schedule
from jppo.models import ModelConfig
from jppo.parallel.mesh import make_mesh
from jppo.run.build import build_critic, build_policy, load_inputs

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_shipped_config_loads():
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        if "gsm8k" in path.name:
            continue  # the real-size configs need a local checkpoint path and GSM8K files (see the README)
        load_config(path)


def test_the_experts_layers_are_checked_against_the_model():
    moe = ROOT / "configs" / "quickstart_moe.yaml"
    assert load_config(moe, ["model.mlp_only_layers=[0]"]).model.mlp_only_layers == (0,)  # layer 1 keeps experts
    with pytest.raises(ConfigError, match=r"^model.mlp_only_layers=\[0, 1\] applies to a model with experts, and this "
                                          r"run's model \('qwen3_moe'\) has no layer with experts$"):
        load_config(moe, ["model.mlp_only_layers=[0,1]"])  # every layer dense: nothing reads the experts' keys
    with pytest.raises(ConfigError, match=r"model.mlp_only_layers=\[-1\] is invalid: it must be layers in \[0, "):
        load_config(moe, ["model.mlp_only_layers=[-1]"])


def test_overrides_and_derived_values():
    cfg = load_config(ROOT / "configs" / "quickstart.yaml", ["rollout.n=4", "actor.ppo_mini_batch_size=16"])
    assert cfg.rollout.n == 4 and cfg.use_critic and not cfg.use_reference
    engine = engine_view(cfg, "actor")
    assert engine.ppo_mini_batch_size == 64  # prompts x rollout.n
    assert engine.loss_scale_factor == cfg.rollout.max_response_length
    assert load_config(None, ["algorithm.adv_estimator=grpo", "rollout.n=2"]).use_critic is False
    assert load_config(None, ["actor.use_kl_loss=true"]).use_reference


@pytest.mark.parametrize("name", ["gspo", "geo_mean"])
def test_sequence_level_policy_losses_load_with_their_mode(name):
    cfg = load_config(ROOT / "configs" / "quickstart.yaml",
                      [f"actor.policy_loss={name}", "actor.loss_agg_mode=seq-mean-token-mean"])
    assert cfg.actor.policy_loss == name and cfg.actor.loss_agg_mode == "seq-mean-token-mean"


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(ROOT / "configs" / "quickstart.yaml", ["trainer.seed=7"])
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == cfg


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["actor.ppo_epoch=2"], "Did you mean: 'ppo_epochs'"),
        (["trainer.total_steps=x"], "trainer.total_steps"),
        (["actor.loss_agg_mode=token_mean"],
         "actor.loss_agg_mode='token_mean' is not valid (did you mean 'token-mean'?)"),
        (["critic.normalization=local"], "critic.normalization='local'"),
        (["algorithm.kl_penalty=k5"], "algorithm.kl_penalty='k5'"),
        (["actor.policy_loss=dro"], "actor.dro_beta=None"),
        (["actor.policy_loss=gspo", "actor.loss_agg_mode=token-mean"],
         "actor.loss_agg_mode='token-mean': actor.policy_loss='gspo' needs actor.loss_agg_mode='seq-mean-token-mean'"),
        (["actor.policy_loss=geo_mean", "actor.loss_agg_mode=seq-mean-token-sum"],
         "actor.loss_agg_mode='seq-mean-token-sum': actor.policy_loss='geo_mean' needs "
         "actor.loss_agg_mode='seq-mean-token-mean'"),
        (["algorithm.adv_estimator=grpo"], "rollout.n=1"),
        (["critic.enable=false"], "critic.enable=False"),
        (["rollout.top_p=0"], "rollout.top_p=0"),
        (["rollout.max_num_seqs=-2"], "rollout.max_num_seqs=-2"),
        (["trainer.resume=/no/such/dir"], "trainer.resume='/no/such/dir'"),
        (["data.task=files"], "data.train_files"),
        (["data.train_batch_size=10", "actor.ppo_mini_batch_size=4"],
         "actor.ppo_mini_batch_size=4 (prompts) does not divide"),
        (["reward.kind=exact"], "reward.kind='exact'"),
        (["reward.function_style=torch"], "reward.function_style='torch' is invalid: valid styles are ['jppo', 'verl'"),
        (["reward.function_style=verl"], "reward.function_style='verl' needs reward.function"),
        (["reward.on_error=skip"], "reward.on_error='skip' is invalid: valid values are ['raise', 'zero']"),
        (["reward.timeout_s=5"], "reward.timeout_s=5.0 needs reward.workers >= 1: a call in the trainer's process"),
        (["reward.workers=2", "reward.timeout_s=0"], "reward.timeout_s=0.0 is invalid: it must be a positive number"),
        (["model.dtype=float8"], "model.dtype='float8'"),
        (["not_a_section.x=1"], "not_a_section"),
        (["actor"], "key.sub=value"),
        # values a component would refuse at run time, refused here under the key that holds them
        (["actor.clip_ratio_c=0.5"], "actor.clip_ratio_c=0.5 is invalid: it must be > 1 (the dual-clip bound)"),
        (["actor.policy_loss=dppo_tv", "actor.clip_ratio_c=0"], "actor.clip_ratio_c=0.0 is invalid: it must be > 0"),
        (["actor.clip_ratio_low=-0.1"], "actor.clip_ratio_low=-0.1 is invalid: it must be >= 0"),
        (["actor.policy_loss=sapo", "actor.tau_neg=0"], "actor.tau_neg=0.0 is invalid: it must be > 0"),
        (["rollout.val_n=0"], "rollout.val_n=0 is invalid: it must be an integer >= 1"),
        (["rollout.val_n=-1"], "rollout.val_n=-1 is invalid: it must be an integer >= 1"),
        (["rollout.top_k=-1"], "rollout.top_k=-1 is invalid: it must be an integer >= 0"),
        (["rollout.max_response_length=0"], "rollout.max_response_length=0 is invalid"),
        (["rollout.val_temperature=nan"], "rollout.val_temperature=nan must be a finite number"),
        (["actor.optim.beta2=1.0"], "actor.optim.beta2=1.0 is invalid: it must be in [0, 1)"),
        (["critic.optim.warmup_steps=-1"], "critic.optim.warmup_steps=-1 is invalid: it must be >= 0"),
        (["model.num_heads=3"], "model.num_heads=3 is invalid: it must be a divisor of hidden_size=64"),
        (["model.num_kv_heads=3"], "model.num_kv_heads=3 is invalid: it must be a divisor of num_heads=8"),
        (["model.max_position_embeddings=0"], "model.max_position_embeddings=0 is invalid"),
        (["algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.horizon=0"],
         "algorithm.kl_ctrl.horizon=0 is invalid: it must be > 0"),
        (["algorithm.gamma=1.5"], "algorithm.gamma=1.5 must be in [0, 1]"),
        (["trainer.max_checkpoints_to_keep=0"], "trainer.max_checkpoints_to_keep=0 must be > 0"),
        (["trainer.seed=-1"], "trainer.seed=-1 must be in [0, 2**32)"),
        (["trainer.resume=''"], "trainer.resume is empty"),
        (["trainer.output_dir=' '"], "trainer.output_dir=' ' must name a directory"),
        (["trainer.output_dir=configs/quickstart.yaml/run"], "quickstart.yaml' is a file, not a directory"),
        (["critic.use_dynamic_bsz=true", "critic.ppo_max_token_len=12"],
         "critic.ppo_max_token_len=12 must be >= the longest sequence, data.max_prompt_length + "
         "rollout.max_response_length = 13 tokens"),
        (["trainer.off_policy_steps=-1"], "trainer.off_policy_steps=-1 must be in [0, 4]"),
        (["trainer.off_policy_steps=5"], "trainer.off_policy_steps=5 must be in [0, 4]"),
        (["trainer.off_policy_steps=1", "actor.old_log_prob=rollout"],
         "actor.old_log_prob='rollout' with trainer.off_policy_steps=1: the sampler's log-probs are the behaviour"),
        (["trainer.off_policy_steps=2", "algorithm.filter_groups.enable=true", "rollout.n=2"],
         "algorithm.filter_groups.enable=True with trainer.off_policy_steps=2: dynamic sampling draws"),
        (["data.task_options=[1,2]"], "override 'data.task_options=[1,2]' is invalid"),
        # OmegaConf's own message about a list element names neither ("Value '$VALUE' of type '$VALUE_TYPE' ...")
        # keys only a model with experts reads, on the quickstart's dense model: refused, not ignored
        (["model.num_experts_per_tok=2"], "model.num_experts_per_tok=2 applies to a model with experts, and this "
         "run's model ('qwen2') has no layer with experts"),
        (["actor.router_z_loss_coef=0.1"], "actor.router_z_loss_coef=0.1 applies to a model with experts"),
        (["critic.router_aux_loss_coef=0.1"], "critic.router_aux_loss_coef=0.1 applies to a model with experts"),
        (["critic.router_z_loss_coef=-1"], "critic.router_z_loss_coef=-1"),
        (["model.mlp_only_layers=[2]"], "model.mlp_only_layers=[2] is invalid: it must be layers in [0, "
         "num_layers=2) (not [2])"),
        (["model.mlp_only_layers=[0,a]"],
         "model.mlp_only_layers=[0, 'a'] is invalid: its element 1, 'a', could not be converted to Integer"),
        (["data.task_options={a: 1"], "override 'data.task_options={a: 1' is not valid YAML"),
    ],
)
def test_errors_name_the_key_and_value(overrides, message):
    with pytest.raises(ConfigError, match=None) as error:
        load_config(ROOT / "configs" / "quickstart.yaml", overrides)
    text = str(error.value)
    assert message in text and "\n" not in text


def test_mesh_and_batch_shards_are_checked_against_the_devices():
    cfg = load_config(ROOT / "configs" / "quickstart.yaml",
                      ["data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=8",
                       "actor.ppo_micro_batch_size=1", "critic.ppo_micro_batch_size=1"])
    assert check_mesh(cfg, 8) == (8, 1, 1, 1, 1)
    with pytest.raises(ConfigError, match="mesh.data=-1 cannot fill 8 devices"):
        check_mesh(load_config(None, ["mesh.fsdp=3"]), 8)
    with pytest.raises(ConfigError, match=r"12 sequences do not split over 8 batch shards"):
        check_mesh(load_config(None, ["data.train_batch_size=12", "actor.ppo_mini_batch_size=12",
                                      "critic.ppo_mini_batch_size=12"]), 8)
    with pytest.raises(ConfigError, match="actor.ppo_micro_batch_size=4 must be between 1 and the 2"):
        check_mesh(load_config(None, ["data.train_batch_size=16", "actor.ppo_mini_batch_size=16",
                                      "actor.ppo_micro_batch_size=4"]), 8)


@pytest.mark.parametrize("name", ["qwen2_5_0_5b_gsm8k_ppo.yaml", "qwen2_5_0_5b_gsm8k_grpo.yaml",
                                  "qwen3_30b_a3b_gsm8k_grpo.yaml"])
def test_accelerator_configs_load_once_their_paths_exist(tmp_path, name):
    (tmp_path / "ckpt").mkdir()
    # only the model keys the config sets are checked against it: the MoE config's, against a model with experts
    experts = {"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 4, "vocab_size": 256, "num_experts": 8, "num_experts_per_tok": 2,
               "moe_intermediate_size": 32}
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(experts) if "a3b" in name else "{}")
    for split in ("train", "test"):
        (tmp_path / f"{split}.jsonl").write_text('{"prompt": "1+1?", "answer": "#### 2"}\n')
    paths = [f"model.path={tmp_path / 'ckpt'}", f"data.train_files={tmp_path / 'train.jsonl'}",
             f"data.val_files={tmp_path / 'test.jsonl'}"]
    cfg = load_config(ROOT / "configs" / name, paths)
    assert cfg.model.dtype == "bfloat16" and cfg.reward.kind == "gsm8k"
    with pytest.raises(ConfigError, match="data.train_files='/path/to/gsm8k/train.jsonl': no such file"):
        load_config(ROOT / "configs" / name)


def test_continuous_batching_slots_must_split_over_the_decoding_shards():
    """Slots the sampler's shards do not divide would make every device decode all of them (the loop on the
    global rows): refused with the nearest sizes that divide; where they divide, or where the batch's rows are
    fewer than the slots (continuous batching off), accepted."""
    sizes = ["data.train_batch_size=16", "actor.ppo_mini_batch_size=16", "critic.ppo_mini_batch_size=16",
             "trainer.val_every=0"]
    with pytest.raises(ConfigError) as error:
        check_mesh(load_config(ROOT / "configs" / "quickstart_grpo.yaml", [*sizes, "rollout.max_num_seqs=60"]), 8)
    assert str(error.value) == ("rollout.max_num_seqs=60 slots do not split over the sampler's 8 decoding shards "
                                "(mesh.data=8): each device decodes its own max_num_seqs / 8; use 56 or 64")
    with pytest.raises(ConfigError, match=r"\(rollout.devices=4\): .* use 4 or 8$"):
        check_mesh(load_config(ROOT / "configs" / "quickstart_grpo.yaml",
                               [*sizes, "rollout.max_num_seqs=6", "rollout.devices=4"]), 8)
    for slots in (64, 200):  # 64: 8 per device; 200: more than the 16 x 8 rows, every row at once
        check_mesh(load_config(ROOT / "configs" / "quickstart_grpo.yaml", [*sizes, f"rollout.max_num_seqs={slots}"]),
                   8)


def test_forward_micro_batch_size_must_divide_the_rows_per_shard():
    with pytest.raises(ConfigError, match="rollout.log_prob_micro_batch_size=3 must divide the 8 sequences"):
        check_mesh(load_config(None, ["data.train_batch_size=64", "actor.ppo_mini_batch_size=32",
                                      "critic.ppo_mini_batch_size=32", "rollout.log_prob_micro_batch_size=3"]), 8)


def test_a_task_given_on_the_command_line_starts_from_its_own_default_options():
    """The quickstart's reverse_digits options (min_len, max_len) are not options of another task: replacing the
    task on the command line drops them (options given along with the new task apply)."""
    quickstart = ROOT / "configs" / "quickstart.yaml"
    assert load_config(quickstart, []).data.task_options == {"min_len": 3, "max_len": 5}
    other = load_config(quickstart, ["data.task=add_small"])
    assert other.data.task == "add_small" and other.data.task_options == {}
    with_options = load_config(quickstart, ["data.task=reverse_digits", "data.task_options.max_len=4"])
    assert with_options.data.task_options == {"min_len": 3, "max_len": 4}  # same task: the file's options stay
    replaced = load_config(quickstart, ["data.task=add_small", "data.task_options.max_operand=9"])
    assert replaced.data.task_options == {"max_operand": 9}


@pytest.mark.parametrize("overrides,message", [
    (["data.task_options={min_len: 4, max_len: 3}"], "data.task_options min_len=4, max_len=3 are invalid"),
    (["data.task_options={min_len: true}"], "data.task_options min_len=True"),
    (["model.tokenizer=abc"], "model.tokenizer='abc': no such local directory, and Hugging Face repo 'abc' is not"),
    (["data.max_prompt_length=2"], "data.max_prompt_length=2"),
])
def test_what_the_inputs_refuse_is_a_config_error(overrides, message):
    """Prompts, vocabulary and rewards are read by load_inputs: their refusals are config errors too."""
    with pytest.raises(ConfigError) as error:
        load_inputs(load_config(ROOT / "configs" / "quickstart.yaml", ["data.num_train_examples=8", *overrides]))
    assert message in str(error.value) and "\n" not in str(error.value)


def test_validation_without_held_out_prompts_is_refused(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"prompt": "12=", "answer": "21"}\n')
    files = ["data.task=files", f"data.train_files={tmp_path / 'train.jsonl'}",
             "model.tokenizer=builtin:reverse_digits"]
    for flag in ("trainer.val_every=5", "trainer.val_before_train=true"):
        with pytest.raises(ConfigError, match=f"{flag.split('=')[0]}=.* needs held-out prompts"):
            load_config(None, [*files, flag])


@pytest.mark.parametrize("overrides,message", [
    (["data.train_files=3"], "data.train_files=3 is invalid: give a path, comma-separated paths, or a list of paths"),
    (["data.train_files=[a.jsonl,[b]]"], "data.train_files=['a.jsonl', ['b']] is invalid: every item of the list"),
    (["data.apply_chat_template_kwargs=thinking"], "data.apply_chat_template_kwargs"),
    (["data.apply_chat_template_kwargs={enable_thinking: false}"], "needs data.apply_chat_template=true"),
])
def test_data_file_lists_and_template_kwargs_are_checked(tmp_path, overrides, message):
    (tmp_path / "train.jsonl").write_text('{"prompt": "12=", "answer": "21"}\n')
    files = ["data.task=files", f"data.train_files={tmp_path / 'train.jsonl'}",
             "model.tokenizer=builtin:reverse_digits"]
    with pytest.raises(ConfigError) as error:
        load_config(None, [*files, *overrides])
    assert message in str(error.value) and "\n" not in str(error.value)
    listed = f"data.train_files=[{tmp_path / 'train.jsonl'},{tmp_path / 'train.jsonl'}]"
    assert load_config(None, [*files, listed]).data.train_files == [str(tmp_path / "train.jsonl")] * 2
    with pytest.raises(ConfigError, match="data.train_files='/no/such.jsonl': no such file"):
        load_config(None, [*files, f"data.train_files=[{tmp_path / 'train.jsonl'},/no/such.jsonl]"])


def test_math_verify_kind_needs_its_package(monkeypatch):
    assert load_config(ROOT / "configs" / "quickstart.yaml", ["reward.kind=math_verify"]).reward.kind == "math_verify"
    monkeypatch.setitem(sys.modules, "math_verify", None)  # as if not installed
    with pytest.raises(ConfigError) as error:
        load_config(ROOT / "configs" / "quickstart.yaml", ["reward.kind=math_verify"])
    assert str(error.value) == "reward.kind='math_verify' needs the package math-verify: pip install 'jppo[math]'"
@pytest.mark.parametrize("half", ["bfloat16", "float16"])
@pytest.mark.parametrize("config", ["quickstart.yaml", "quickstart_grpo.yaml"])  # with and without a critic
def test_half_precision_trained_weights_are_refused_for_float32_master_weights(config, half):
    with pytest.raises(ConfigError) as error:
        load_config(ROOT / "configs" / config, [f"model.param_dtype={half}"])
    text = str(error.value)
    assert text.startswith(f"model.param_dtype='{half}'") and "\n" not in text
    assert "float32 master weights with model.dtype: bfloat16" in text
    # the documented mixed-precision path loads
    mixed = load_config(ROOT / "configs" / config, ["model.param_dtype=float32", "model.dtype=bfloat16"])
    assert (mixed.model.param_dtype, mixed.model.dtype) == ("float32", "bfloat16")


def test_mixed_precision_trains_float32_weights_of_actor_and_critic():
    """The critic takes its dtypes from the model section, so refusing half-precision ``model.param_dtype`` covers
    every trained model."""
    cfg = load_config(ROOT / "configs" / "quickstart.yaml", ["model.param_dtype=float32", "model.dtype=bfloat16"])
    mesh = make_mesh(devices=jax.devices()[:1])
    policy = build_policy(cfg, load_inputs(cfg).tokenizer, mesh)
    critic = build_critic(cfg, policy, mesh)
    for model in (policy, critic):
        assert model.config.dtype == "bfloat16"
        assert {leaf.dtype for leaf in jax.tree.leaves(nnx.state(model, nnx.Param))} == {jnp.dtype(jnp.float32)}


def test_a_cosine_schedule_decays_over_the_run():
    """Without optim.decay_steps the cosine decay spans the role's training steps after warm-up, ending on the last
    one (it used to end after one optimizer step; it then counted optimizer steps)."""
    cfg = load_config(ROOT / "configs" / "quickstart.yaml", [
        "actor.optim.lr_schedule=cosine", "actor.optim.warmup_steps=10", "critic.optim.lr_schedule=cosine",
        "trainer.critic_warmup=4",
    ])
    # 400 training steps; the actor sits out 4 and warms up over 10; the last step is the floor
    assert engine_view(cfg, "critic").optim.decay_steps == 400 - 1
    assert engine_view(cfg, "actor").optim.decay_steps == 396 - 10 - 1
    explicit = load_config(None, ["actor.optim.lr_schedule=cosine", "actor.optim.decay_steps=7"])
    assert engine_view(explicit, "actor").optim.decay_steps == 7


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_the_learning_rate_schedule_counts_training_steps(role):
    """As in verl (one scheduler step per training step): over a whole run, the LR is constant within a training
    step, warm-up peaks on training step ``warmup_steps`` (1-based) and the cosine reaches its floor on the last."""
    lr, floor, warmup = 0.01, 0.1, 3
    cfg = load_config(ROOT / "configs" / "quickstart.yaml", [
        "trainer.total_steps=12", "trainer.critic_warmup=2", f"{role}.optim.lr_schedule=cosine",
        f"{role}.optim.lr={lr}", f"{role}.optim.warmup_steps={warmup}", f"{role}.optim.min_lr_ratio={floor}",
    ])
    section = getattr(cfg, role)
    view = engine_view(cfg, role)
    per_step = section.ppo_epochs * cfg.data.train_batch_size // section.ppo_mini_batch_size
    assert view.optimizer_steps_per_training_step == per_step > 1
    steps = cfg.trainer.total_steps - (cfg.trainer.critic_warmup if role == "actor" else 0)
    schedule = learning_rate_schedule(view.optim, view.optimizer_steps_per_training_step)
    rates = np.array([float(schedule(count)) for count in range(steps * per_step)]).reshape(steps, per_step)
    assert (rates == rates[:, :1]).all()  # constant inside each training step
    by_step = rates[:, 0]
    assert (np.diff(by_step[:warmup]) > 0).all() and by_step[warmup - 1] == pytest.approx(lr)
    assert (np.diff(by_step[warmup - 1:]) <= 1e-12).all() and by_step[-2] > floor * lr * (1 + 1e-6)
    assert by_step[-1] == pytest.approx(floor * lr)


def test_the_engine_gets_its_own_view_in_sequences_with_every_constant_resolved():
    cfg = load_config(ROOT / "configs" / "quickstart.yaml", ["rollout.n=4", "actor.ppo_mini_batch_size=16",
                                                             "critic.loss_scale_factor=3"])
    actor, critic = engine_view(cfg, "actor"), engine_view(cfg, "critic")
    assert type(actor) is ActorConfig and type(critic) is CriticConfig and isinstance(cfg.actor, ActorSection)
    assert (actor.ppo_mini_batch_size, cfg.actor.ppo_mini_batch_size) == (64, 16)
    assert (actor.loss_scale_factor, critic.loss_scale_factor) == (5.0, 3.0)
    for name in ("ppo_micro_batch_size", "ppo_epochs", "normalization", "entropy_coeff", "use_dynamic_bsz"):
        assert getattr(actor, name) == getattr(cfg.actor, name)
    with pytest.raises(TypeError, match="got ActorSection"):  # a count of prompts never reaches the engine
        mini_batches(64, cfg.actor, np.random.default_rng(0))


def test_the_model_section_declares_model_config_fields_under_their_yaml_keys():
    cfg = load_config(ROOT / "configs" / "quickstart.yaml", ["model.num_kv_heads=4", "model.remat=true"])
    built = ModelConfig(**cfg.model.architecture(), vocab_size=14)
    assert (built.hidden_size, built.num_heads, built.num_kv_heads, built.rope_theta) == (64, 8, 4, 100.0)
    assert built.model_type == "qwen2" and built.remat and built.tie_word_embeddings
    assert ModelSection().max_position_embeddings == 512 and ModelSection().path is None


@pytest.mark.parametrize("overrides,devices,message", [
    (["data.train_batch_size=8", "rollout.n=8", "actor.ppo_mini_batch_size=3"], None,
     "actor.ppo_mini_batch_size=3 (prompts) does not divide data.train_batch_size=8"),
    (["data.train_batch_size=8", "rollout.n=2", "actor.ppo_mini_batch_size=2", "critic.ppo_mini_batch_size=8"], 8,
     "actor.ppo_mini_batch_size=2 (prompts) x rollout.n=2 = 4 sequences does not split over 8 batch shards"),
    (["data.train_batch_size=8", "rollout.n=4", "actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=4",
      "critic.ppo_micro_batch_size=4"], 8,
     "critic.ppo_micro_batch_size=4 must be between 1 and the 2 sequences per batch shard of a mini-batch "
     "(critic.ppo_mini_batch_size=4 (prompts) x rollout.n=4 = 16 sequences over 8 shards)"),
])
def test_batch_size_errors_name_the_key_and_the_prompts_the_user_wrote(overrides, devices, message):
    """A mini-batch of prompts is reported as prompts (with what they make for the engine), before anything
    compiles: by load_config where no mesh is involved, by check_mesh against the batch shards."""
    with pytest.raises(ConfigError) as error:
        cfg = load_config(ROOT / "configs" / "quickstart.yaml", ["actor.ppo_micro_batch_size=1",
                                                                 "critic.ppo_micro_batch_size=1", *overrides])
        assert devices is not None, "load_config accepted it"
        check_mesh(cfg, devices)
    assert str(error.value) == message


def test_no_batch_size_error_counts_only_sequences():
    """Whatever the mini-batch, micro-batch and rollout.n, a refusal names the prompts the user wrote: the engine's
    own check (worded in sequences for direct users) is reached only through the trainer's wording."""
    refused = 0
    for n in (1, 2, 3, 8):
        for mini in (1, 2, 3, 8):
            for micro in (1, 2, 4):
                sizes = [f"rollout.n={n}", "data.train_batch_size=8", f"actor.ppo_mini_batch_size={mini}",
                         f"actor.ppo_micro_batch_size={micro}", "critic.enable=false",
                         "algorithm.adv_estimator=grpo" if n > 1 else "algorithm.adv_estimator=reinforce_plus_plus"]
                try:
                    check_mesh(load_config(ROOT / "configs" / "quickstart.yaml", sizes), 8)
                except ConfigError as error:
                    refused += 1
                    text = str(error)
                    assert "\n" not in text and not re.search(r"ppo_mini_batch_size=\d+ sequences", text), text
                    if "ppo_mini_batch_size" in text:
                        assert f"actor.ppo_mini_batch_size={mini} (prompts)" in text, text
    assert refused > 0


# The ModelConfig fields the model section leaves out: the vocabulary and its special tokens are the tokenizer's
# (or a checkpoint's), and the family flags, head size, norm epsilon and rope scaling are model_type's defaults
# (a checkpoint brings its own).
MODEL_KEYS_LEFT_OUT = {
    "vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "head_dim", "rope_scaling", "rms_norm_eps",
    "attention_bias", "attention_out_bias", "qk_norm",
}
# Where the section's default is the small test model's, not ModelConfig's (which has none for the sizes).
TEST_MODEL_DEFAULTS = dict(model_type="qwen2", hidden_size=64, intermediate_size=256, num_layers=2, num_heads=4,
                           tie_word_embeddings=True, max_position_embeddings=512)


def _union_as_set(kind):
    """``Optional[int]`` and ``int | None`` alike, as the set of their members."""
    union = typing.get_origin(kind) in (typing.Union, types.UnionType)
    return frozenset(typing.get_args(kind)) if union else kind


def test_the_model_section_keys_are_model_config_fields():
    """ModelSection's keys are written out in the schema: each is the ModelConfig field of its name and type, with
    ModelConfig's default unless it is the test model's, and every ModelConfig field is a key or left out on
    purpose, so the two cannot drift apart."""
    section = {f.name: f for f in dataclasses.fields(ModelSection) if f.name not in ("path", "tokenizer")}
    model = {f.name: f for f in dataclasses.fields(ModelConfig)}
    assert set(section) == set(model) - MODEL_KEYS_LEFT_OUT
    assert set(TEST_MODEL_DEFAULTS) <= set(section)
    section_types, model_types = typing.get_type_hints(ModelSection), typing.get_type_hints(ModelConfig)
    for name, field in section.items():
        assert _union_as_set(section_types[name]) == _union_as_set(model_types[name]), name
        assert field.default == TEST_MODEL_DEFAULTS.get(name, model[name].default), name
    assert ModelSection().architecture() == RANDOM_MODEL == {name: f.default for name, f in section.items()}
