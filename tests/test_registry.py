"""One way to register an extension: a ``Registry`` per kind, filled by a decorator where the extension is written.

For each kind, an extension registered in this test module is accepted by ``load_config`` under its name and used
by the component that runs it, and an unknown name keeps its one-line error. A fixture puts every registry back
as it was after each test, so nothing registered here reaches another test.
"""

import dataclasses
import pathlib
import pkgutil

import jax.numpy as jnp
import numpy as np
import pytest

import jppo.run.checks  # noqa: F401 (the components' checks of a config, as every command loads them)
from jppo.advantages import ADVANTAGE_ESTIMATORS, register_estimator
from jppo.advantages.estimate import compute_advantages
from jppo.config import ConfigError, load_config
from jppo.core.masked import global_norm_stats
from jppo.core.registry import Registry
from jppo.core.settings import ActorFields
from jppo.data import BUILTIN_TASKS, Example, get_task
from jppo.data.tasks import positional_match
from jppo.engine.objectives import policy_options
from jppo.losses import POLICY_LOSSES, PerToken, PolicyLossOptions, actor_loss, register_policy_loss
from jppo.losses.policy import OPTION_RULES, REQUIRED_AGG_MODES
from jppo.models import MODEL_FAMILIES, ModelConfig
from jppo.models.families import Llama
from jppo.rewards import REWARD_KINDS, RewardConfig, build_credit_fn, build_reward_fn
from jppo.rollout.env import BUILTIN_ENVS, load_env
from jppo.runlog import SINKS, RunLogger, sinks

QUICKSTART = pathlib.Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
REGISTRIES = (POLICY_LOSSES, ADVANTAGE_ESTIMATORS, BUILTIN_ENVS, BUILTIN_TASKS, REWARD_KINDS, SINKS, MODEL_FAMILIES)


@pytest.fixture(autouse=True)
def restored_registries():
    """Every registry (and the policy losses' side tables) as it was before the test."""
    tables = [registry._entries for registry in REGISTRIES] + [OPTION_RULES, REQUIRED_AGG_MODES]
    saved = [dict(table) for table in tables]
    yield
    for table, before in zip(tables, saved):
        table.clear()
        table.update(before)


def test_a_registry_keeps_names_in_order_refuses_a_second_entry_and_lists_the_names_of_an_unknown_one():
    things = Registry("thing")
    first = things.register("b")(lambda: 1)
    things.register("a")(2)
    assert first() == 1 and things.lookup("b") is first and things.names() == ("b", "a") and list(things) == ["b", "a"]
    assert "a" in things and len(things) == 2 and things.get("c") is None
    with pytest.raises(ValueError, match=r"^thing 'a' is already registered$"):
        things.register("a")(3)
    assert things.lookup("a") == 2
    with pytest.raises(ValueError, match=r"^unknown thing 'c'; valid: b, a$"):
        things.lookup("c")
    worded = Registry("thing", lambda name, names: f"no {name}; only {'/'.join(sorted(names))}")
    worded.register("z")(0)
    worded.register("y")(0)
    with pytest.raises(ValueError, match=r"^no x; only y/z$"):
        worded.lookup("x")
    with pytest.raises(ValueError, match="non-empty name"):
        things.register("")


def test_a_policy_loss_registered_in_its_file_is_a_config_choice_and_gets_its_options():
    @register_policy_loss("scaled_pg")
    def scaled_pg(log_prob, old_log_prob, advantages, mask, options):
        no_clip = jnp.zeros_like(mask, dtype=bool)
        return PerToken(-options.clip_ratio * advantages * log_prob, no_clip, no_clip, old_log_prob - log_prob)

    cfg = load_config(QUICKSTART, ["actor.policy_loss=scaled_pg", "actor.clip_ratio=0.5"])
    mask = jnp.array([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    log_prob = jnp.array([[-1.0, -2.0, 9.0], [-3.0, 9.0, 9.0]])
    advantages = jnp.array([[1.0, 2.0, 9.0], [-1.0, 9.0, 9.0]])
    share, _ = actor_loss(
        log_prob, log_prob, advantages, mask, norm=global_norm_stats(mask), mode=cfg.actor.loss_agg_mode,
        policy_loss_name=cfg.actor.policy_loss, policy_options=policy_options(cfg.actor),
    )
    np.testing.assert_allclose(share, 0.5 * (1 * 1 + 2 * 2 - 1 * 3) / 3)
    with pytest.raises(ConfigError, match=r"^actor.policy_loss='nope' is not valid; valid: cispo, .*scaled_pg, "):
        load_config(QUICKSTART, ["actor.policy_loss=nope"])


def test_the_actor_declares_the_policy_loss_options_once_as_the_options_own_fields():
    actor = ActorFields.__dataclass_fields__
    for name, field in PolicyLossOptions.__dataclass_fields__.items():
        assert actor[name] is field  # the same declaration, not a copy that could drift
    assert policy_options(ActorFields(clip_ratio_high=0.28)) == PolicyLossOptions(clip_ratio_high=0.28)


def test_an_estimator_registered_in_its_file_is_a_config_choice_run_by_the_collector():
    @register_estimator("group_sum")
    def group_sum(token_level_rewards, mask, group_ids):
        advantages = (token_level_rewards * mask).sum(-1, keepdims=True) * mask + 0 * group_ids[:, None]
        return advantages, advantages

    cfg = load_config(QUICKSTART, ["algorithm.adv_estimator=group_sum", "rollout.n=2"])
    assert not cfg.use_critic and ADVANTAGE_ESTIMATORS[cfg.algorithm.adv_estimator].needs_group_ids
    rewards, mask = np.array([[0.0, 1.0], [2.0, 0.5]], np.float32), np.array([[1, 1], [1, 0]], np.float32)
    advantages, _ = compute_advantages(
        cfg.algorithm.adv_estimator, token_level_rewards=rewards, response_mask=mask, group_ids=np.array([0, 0])
    )
    np.testing.assert_allclose(advantages, [[1.0, 1.0], [2.0, 0.0]])
    with pytest.raises(ConfigError, match=r"^algorithm.adv_estimator='nope' is not valid; valid: gae, .*group_sum"):
        load_config(QUICKSTART, ["algorithm.adv_estimator=nope"])
    with pytest.raises(ValueError, match=r"^unknown advantage estimator 'nope'; valid estimators: gae, gpg, group_sum"):
        compute_advantages("nope", token_level_rewards=rewards, response_mask=mask)


def test_an_environment_registered_in_its_file_is_a_builtin_choice():
    @BUILTIN_ENVS.register("echo")
    class Echo:
        stop = ("]",)

        def reset(self, prompt, example):
            return ""

        def step(self, action):
            return action, 0.0, True

    cfg = load_config(QUICKSTART, ["rollout.env=builtin:echo"])
    assert load_env(cfg.rollout.env)().step("4]") == ("4]", 0.0, True)
    valid = "builtin:calculator, builtin:echo"
    with pytest.raises(ConfigError, match=rf"^rollout.env='builtin:nope' is not valid .*; valid: {valid}$"):
        load_config(QUICKSTART, ["rollout.env=builtin:nope"])
    with pytest.raises(ValueError, match=r"^rollout.env='builtin:nope' is unknown; built-in environments: \['builtin:"):
        load_env("builtin:nope")


def test_a_task_registered_in_its_file_is_a_data_task_with_its_own_vocabulary():
    @BUILTIN_TASKS.register("copy_digit")
    @dataclasses.dataclass(frozen=True)
    class CopyDigit:
        name: str = dataclasses.field(default="copy_digit", init=False)
        alphabet: str = dataclasses.field(default="0123456789=", init=False)

        def examples(self, split, n, seed):
            return [Example(f"{i % 10}=", str(i % 10)) for i in range(n)]

        def score(self, response_text, example):
            return positional_match(response_text, example.answer)

        def follows_format(self, response_text):
            return response_text.isdigit()

    cfg = load_config(QUICKSTART, ["data.task=copy_digit", "data.task_options={}", "reward.token_level=false"])
    task = get_task(cfg.data.task, cfg.data.task_options)
    assert task.name == "copy_digit" and task.score("7", task.examples("train", 8, 0)[7]) == 1.0
    with pytest.raises(ConfigError, match=r"data.task='nope' is unknown; valid tasks: \['add_small', 'copy_digit'"):
        load_config(QUICKSTART, ["data.task=nope"])
    # per-position credit is what a task class has, not a list of names: copy_digit has none
    with pytest.raises(ValueError, match=r"\(built-in tasks: add_small, reverse_digits, tool_multiply\)$"):
        build_credit_fn(dataclasses.replace(cfg.reward, token_level=True), task)
    with pytest.raises(ValueError, match=r"^data.task='nope' is unknown; valid tasks: \['add_small', 'copy_digit'"):
        get_task("nope")


def test_a_reward_kind_registered_in_its_file_scores_and_has_a_format():
    @REWARD_KINDS.register("length")
    class LengthKind:
        @staticmethod
        def scorer(cfg, task):
            return lambda text, example, finished: float(len(text))

        @staticmethod
        def answer_format(cfg, task):
            return lambda text: text.endswith(".")

    cfg = load_config(QUICKSTART, ["reward.kind=length", "reward.format_weight=10", "reward.token_level=false"])
    reward = build_reward_fn(cfg.reward, None)
    np.testing.assert_array_equal(reward(["ab.", "abc"], [Example("", "")] * 2, [True, True]), [13.0, 3.0])
    # the registry's names are checked with the config (jppo.rewards.reward_fn registers the check) and at use
    with pytest.raises(ValueError, match=r"^reward.kind='nope' is invalid: valid kinds are \['task', .*, 'length'\]$"):
        load_config(QUICKSTART, ["reward.kind=nope"])
    with pytest.raises(ValueError, match=r"^reward.kind='nope' is invalid: valid kinds are \['task', .*, 'length'\]$"):
        build_reward_fn(RewardConfig(kind="nope"), None)


def test_every_module_of_the_sinks_package_is_loaded_and_registers_the_sink_it_is_named_after():
    assert SINKS.names() == tuple(module.name for module in pkgutil.iter_modules(sinks.__path__))


def test_a_sink_registered_in_its_file_is_a_logger_choice_that_gets_the_checked_metrics(tmp_path):
    received = []

    @SINKS.register("memory")
    class MemorySink:
        def __init__(self, run):
            self.total_steps = run.total_steps

        def log(self, step, values):
            received.append((self.total_steps, step, values))

        def log_generations(self, step, records):
            pass

        def close(self):
            received.append("closed")

    load_config(QUICKSTART, ["trainer.logger=[console,memory]"])
    with RunLogger(tmp_path, total_steps=2, sinks=["memory"]) as logger:
        logger.log(1, {"reward/mean": np.float32(0.5)})
    assert received == [(2, 1, {"reward/mean": 0.5}), "closed"] and not list(tmp_path.iterdir())
    valid = "console, jsonl, tensorboard, wandb, memory"
    with pytest.raises(ConfigError, match=rf"^trainer.logger='nope' is not valid; valid: {valid}$"):
        load_config(QUICKSTART, ["trainer.logger=[nope]"])


def test_a_model_family_registered_in_its_file_is_a_model_type_read_and_written_by_its_record():
    @MODEL_FAMILIES.register("llama_qk")
    class LlamaWithQkNorm(Llama):
        hf_architecture = "LlamaQk"
        fixed_flags = {"qk_norm": True}
        default_head_dim = 16

    cfg = load_config(QUICKSTART, ["model.model_type=llama_qk"])
    assert cfg.model.model_type == "llama_qk"
    config = ModelConfig(vocab_size=32, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=2,
                         model_type="llama_qk")
    hf = config.to_hf()
    assert config.qk_norm and hf["architectures"] == ["LlamaQkForCausalLM"] and hf["mlp_bias"] is False
    assert ModelConfig.from_hf({**hf, "head_dim": None}).head_dim == 16
    assert ModelConfig.from_hf(hf) == config
    families = "llama, qwen2, qwen3, qwen3_moe, llama_qk"
    with pytest.raises(ConfigError, match=rf"^model.model_type='nope' is not valid; valid: {families}$"):
        load_config(QUICKSTART, ["model.model_type=nope"])
    with pytest.raises(ValueError, match=rf"^unsupported model_type 'gpt2'; supported: {families}$"):
        ModelConfig(vocab_size=32, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=2, model_type="gpt2")
