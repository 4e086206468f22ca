"""The trainer's config: schema defaults, YAML + overrides, and one-line errors naming key and value."""

import pathlib

import pytest

from jppo.config import ConfigError, check_mesh, engine_update_config, load_config, save_config

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_shipped_config_loads():
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        if "0_5b" in path.name:
            continue  # these need a local checkpoint path (see the README)
        load_config(path)


def test_overrides_and_derived_values():
    cfg = load_config(ROOT / "configs" / "quickstart.yaml", ["rollout.n=4", "actor.ppo_mini_batch_size=16"])
    assert cfg.rollout.n == 4 and cfg.use_critic and not cfg.use_reference
    engine = engine_update_config(cfg, "actor")
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
        (["actor.loss_agg_mode=token_mean"], "actor.loss_agg_mode='token_mean' is not valid (did you mean 'token-mean'?)"),
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
        (["trainer.resume=/no/such/dir"], "trainer.resume='/no/such/dir'"),
        (["data.task=files"], "data.train_files"),
        (["data.train_batch_size=10", "actor.ppo_mini_batch_size=4"], "actor.ppo_mini_batch_size=4 prompts does not divide"),
        (["reward.kind=exact"], "reward.kind='exact'"),
        (["model.dtype=float8"], "model.dtype='float8'"),
        (["not_a_section.x=1"], "not_a_section"),
        (["actor"], "key.sub=value"),
    ],
)
def test_errors_name_the_key_and_value(overrides, message):
    with pytest.raises(ConfigError, match=None) as error:
        load_config(ROOT / "configs" / "quickstart.yaml", overrides)
    text = str(error.value)
    assert message in text and "\n" not in text


def test_mesh_and_batch_shards_are_checked_against_the_devices():
    cfg = load_config(ROOT / "configs" / "quickstart.yaml", ["data.train_batch_size=8", "actor.ppo_mini_batch_size=8",
                                                             "critic.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size=1",
                                                             "critic.ppo_micro_batch_size=1"])
    assert check_mesh(cfg, 8) == (8, 1, 1)
    with pytest.raises(ConfigError, match="mesh.data=-1 cannot fill 8 devices"):
        check_mesh(load_config(None, ["mesh.fsdp=3"]), 8)
    with pytest.raises(ConfigError, match=r"12 sequences do not split over 8 batch shards"):
        check_mesh(load_config(None, ["data.train_batch_size=12", "actor.ppo_mini_batch_size=12",
                                      "critic.ppo_mini_batch_size=12"]), 8)
    with pytest.raises(ConfigError, match="actor.ppo_micro_batch_size=4 must be between 1 and the 2"):
        check_mesh(load_config(None, ["data.train_batch_size=16", "actor.ppo_mini_batch_size=16",
                                      "actor.ppo_micro_batch_size=4"]), 8)


@pytest.mark.parametrize("name", ["qwen2_5_0_5b_gsm8k_ppo.yaml", "qwen2_5_0_5b_gsm8k_grpo.yaml"])
def test_accelerator_configs_load_once_their_paths_exist(tmp_path, name):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    for split in ("train", "test"):
        (tmp_path / f"{split}.jsonl").write_text('{"prompt": "1+1?", "answer": "#### 2"}\n')
    paths = [f"model.path={tmp_path / 'ckpt'}", f"data.train_files={tmp_path / 'train.jsonl'}",
             f"data.val_files={tmp_path / 'test.jsonl'}"]
    cfg = load_config(ROOT / "configs" / name, paths)
    assert cfg.model.dtype == "bfloat16" and cfg.reward.kind == "gsm8k"
    with pytest.raises(ConfigError, match="data.train_files='/path/to/gsm8k/train.jsonl': no such file"):
        load_config(ROOT / "configs" / name)


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
