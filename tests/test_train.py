"""The trainer end to end on the quickstart configs (8 simulated CPU devices): it runs, writes what it promises,
and resumes exactly, also on another mesh (whole runs on other meshes and cuts: ``test_whole_run.py``)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import re
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jppo.config import check_mesh, load_config
from jppo.parallel.mesh import make_mesh
from jppo.run import build
from jppo.run.collect import decode_responses, greedy_baselines
from jppo.run.loop import run, setup

ROOT = pathlib.Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
GRPO = ROOT / "configs" / "quickstart_grpo.yaml"
# Small and fast: a few prompts per step, no validation, no plots unless a test asks.
SMALL = [
    "data.train_batch_size=16", "actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=8",
    "actor.ppo_micro_batch_size=1", "critic.ppo_micro_batch_size=1", "trainer.val_every=0", "trainer.plots=false",
    "trainer.logger=[console,jsonl]", "trainer.progress_bar=false",
]


def train(tmp: pathlib.Path, *overrides: str, config: pathlib.Path = QUICKSTART) -> list[dict]:
    cfg = load_config(config, [*SMALL, f"trainer.output_dir={tmp}", *overrides])
    run(cfg, check_mesh(cfg, jax.device_count()), build.load_inputs(cfg))
    return [json.loads(line) for line in (tmp / "metrics.jsonl").read_text().splitlines()]


def deterministic(metrics: dict) -> dict:
    """Everything but wall-clock measurements."""
    return {k: v for k, v in metrics.items() if not k.startswith(("timing/", "perf/"))}


def test_quickstart_smoke_writes_metrics_checkpoints_plots_and_config(tmp_path):
    rows = train(tmp_path, "trainer.total_steps=2", "trainer.plots=true", "trainer.logger=[console,jsonl,tensorboard]",
                 "trainer.val_every=2", "data.num_val_examples=16", "data.val_batch_size=16", "trainer.export_hf=true")
    assert [row["step"] for row in rows] == [1, 2]
    for name in ("reward/mean", "actor/pg_loss", "critic/vf_loss", "actor/grad_norm", "critic/grad_norm",
                 "actor/pg_clipfrac", "actor/ppo_kl", "response_length/mean", "timing/rollout", "perf/tokens_per_s"):
        assert all(math.isfinite(row[name]) for row in rows), name
    assert "val/reward/mean" in rows[1]
    # sampler and trainer agree on the log-probs of the sampled tokens (same float32 model, same temperature)
    assert rows[0]["rollout/log_prob_abs_diff"] < 1e-4
    assert (tmp_path / "config.yaml").is_file()
    assert (tmp_path / "checkpoints" / "2").is_dir()
    assert list((tmp_path / "tensorboard").iterdir())
    assert (tmp_path / "plots" / "summary.png").is_file()
    assert (tmp_path / "hf" / "config.json").is_file() and (tmp_path / "hf" / "model.safetensors").is_file()


def test_validation_before_training_is_logged_at_step_zero_and_plotted(tmp_path):
    """``trainer.val_before_train`` validates the initial policy and logs it at step 0 (verl's global step 0); the
    plots show it, and a resumed run does not repeat it."""
    val = ["trainer.val_before_train=true", "data.num_val_examples=16", "data.val_batch_size=16"]
    rows = train(tmp_path, "trainer.total_steps=1", "trainer.plots=true",
                 "trainer.logger=[console,jsonl,tensorboard]", *val)
    assert [row["step"] for row in rows] == [0, 1]
    assert set(rows[0]) == {"step", "val/reward/mean", "val/accuracy"} and 0 <= rows[0]["val/reward/mean"] <= 1
    assert (tmp_path / "plots" / "validation.png").is_file()
    resumed = train(tmp_path, "trainer.total_steps=2", *val)
    assert [row["step"] for row in resumed] == [0, 1, 2] and resumed[0] == rows[0]


def test_grpo_config_trains_without_a_critic_on_group_relative_advantages(tmp_path, monkeypatch):
    import jppo.run.collect as collect_module

    seen = []
    real = collect_module.compute_advantages

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append((kwargs["group_ids"], kwargs["response_mask"], kwargs["token_level_rewards"], out[0]))
        return out

    monkeypatch.setattr(collect_module, "compute_advantages", spy)
    rows = train(tmp_path, "trainer.total_steps=2", "data.train_batch_size=4", "actor.ppo_mini_batch_size=2",
                 config=GRPO)
    assert all(math.isfinite(row["actor/pg_loss"]) for row in rows)
    assert not any(key.startswith("critic/") for key in rows[0])
    assert len(seen) == 2
    varied = 0
    for groups, mask, rewards, advantages in seen:
        mask = np.asarray(mask, bool)
        score = np.asarray(rewards).sum(axis=1)  # each response's outcome reward
        row_advantage = np.asarray(advantages)[np.arange(len(mask)), mask.argmax(axis=1)]
        # one advantage per response, on every one of its tokens, zero elsewhere
        np.testing.assert_allclose(np.where(mask, advantages, 0), np.where(mask, row_advantage[:, None], 0))
        for group in np.unique(groups):
            members = (groups == group) & mask.any(axis=1)
            adv, reward = row_advantage[members], score[members]
            # (r - mean) / (std + eps) within the prompt's group: zero mean, same order as the rewards (float32)
            np.testing.assert_allclose(adv.mean(), 0.0, atol=1e-5)
            if reward.std() > 0:
                varied += 1
                np.testing.assert_allclose(adv, (reward - reward.mean()) / (reward.std(ddof=1) + 1e-6), rtol=1e-4,
                                           atol=1e-5)
            else:
                assert np.all(adv == 0)
    assert varied > 0  # else the comparison with the rewards above checked nothing


def test_remax_baseline_is_the_reward_of_the_greedy_response(tmp_path):
    # a plug-in reward that tells prompts and responses apart even for an untrained policy
    plugin = tmp_path / "reward.py"
    plugin.write_text(
        "def reward(responses, examples, finished):\n"
        "    return [int(e.answer) % 97 + sum(map(ord, r)) % 10 / 10 for r, e in zip(responses, examples)]\n"
    )
    overrides = ["algorithm.adv_estimator=remax", "data.train_batch_size=4", "actor.ppo_mini_batch_size=2",
                 f"reward.function={plugin}:reward"]
    cfg = load_config(GRPO, [*SMALL, f"trainer.output_dir={tmp_path / 'run'}", *overrides])
    state, collector, _, _ = setup(cfg, make_mesh(*check_mesh(cfg, jax.device_count())), build.load_inputs(cfg))
    examples, prompts, _ = collector.inputs.train_data.batch_at(0, 4, cfg.trainer.seed)
    prompt_index = collector.sampler(state.actor.params, prompts, jax.random.key(0)).group_ids
    baselines = greedy_baselines(collector, state, examples, prompts, prompt_index, step=1)
    # the expectation, built another way: validation decodes greedily, one response per prompt, by default
    assert cfg.rollout.val_temperature == 0 and cfg.rollout.val_n == 1
    greedy = collector.val_sampler(state.actor.params, prompts, jax.random.key(1))
    greedy_index = greedy.group_ids
    greedy_texts, _ = decode_responses(greedy, collector.inputs.tokenizer)
    reward_of_prompt = {
        int(p): int(examples[p].answer) % 97 + sum(map(ord, text)) % 10 / 10
        for p, text in zip(greedy_index, greedy_texts)
    }
    assert len(set(reward_of_prompt.values())) > 1  # else the comparison below could not tell prompts apart
    assert len(baselines) == len(prompt_index) == 4 * cfg.rollout.n
    np.testing.assert_allclose(baselines, [reward_of_prompt[int(p)] for p in prompt_index], rtol=1e-6)  # float32

    rows = train(tmp_path / "run", "trainer.total_steps=2", *overrides, config=GRPO)
    assert all(math.isfinite(row["actor/pg_loss"]) and row["timing/reward_baseline"] > 0 for row in rows)
    assert not any(key.startswith("critic/") for key in rows[0])


def test_reward_workers_score_a_run_as_the_trainers_process_does(tmp_path):
    # a plug-in that raises on some rows: under reward.on_error=zero they score 0 and are counted, and every
    # other row's reward is the one computed in the trainer's process, so the two runs are one run
    plugin = tmp_path / "reward.py"
    plugin.write_text(
        "def reward(responses, examples):\n"
        "    codes = [sum(map(ord, r)) for r in responses]\n"
        "    if any(code % 3 == 0 for code in codes):\n"
        "        raise ValueError('a row this scorer cannot score')\n"
        "    return [code % 10 / 10 for code in codes]\n"
    )
    common = ["trainer.total_steps=1", f"reward.function={plugin}:reward", "reward.on_error=zero"]
    inside = train(tmp_path / "inside", *common, config=GRPO)
    workers = train(tmp_path / "workers", *common, "reward.workers=2", "reward.timeout_s=60", config=GRPO)
    assert inside[0]["reward/errors"] > 0 and inside[0]["reward/timeouts"] == 0
    assert deterministic(workers[0]) == deterministic(inside[0])


def test_a_signal_skips_the_steps_validation_and_ends_start_up_or_export_in_the_resume_status(tmp_path, monkeypatch):
    """SIGTERM during a step that validates: the run saves that step without validating it (a validation could
    outlast the grace period); during input loading or the final export: exit status 75 all the same, and the
    same command then finishes the run."""
    from signals import signal_at

    import jppo.run.lifecycle as lifecycle
    import jppo.run.loop as loop
    import jppo.train as command
    from jppo.parallel.preemption import PREEMPTED_EXIT
    from jppo.run.checkpoint import committed_steps

    argv = ["--config", str(QUICKSTART), f"trainer.output_dir={tmp_path}", *SMALL, "trainer.total_steps=2",
            "trainer.val_every=1", "data.num_val_examples=16", "data.val_batch_size=16", "trainer.export_hf=true"]
    # a stopped command ignores later signals on its way out: the test's handlers are put back at its end
    handlers = {number: signal.getsignal(number) for number in (signal.SIGTERM, signal.SIGUSR1)}
    killer = tmp_path / "killer.py"  # a reward plug-in whose loading is interrupted: the signal lands in start-up
    killer.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\ndef reward(r, e):\n    return [0.0]\n")
    assert command.main([*argv, f"reward.function={killer}:reward"]) == PREEMPTED_EXIT
    assert not (tmp_path / "checkpoints").exists() or committed_steps(tmp_path / "checkpoints") == []

    validated = []
    evaluate_and_log = loop.evaluate_and_log
    monkeypatch.setattr(loop, "evaluate_and_log", lambda *a: validated.append(a[2]) or evaluate_and_log(*a))
    with monkeypatch.context() as patch:
        signal_at(patch, 1, "update", signal.SIGTERM)
        assert command.main(argv) == PREEMPTED_EXIT
    assert validated == [] and committed_steps(tmp_path / "checkpoints") == [1]
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in logged] == [1] and not any(key.startswith("val/") for key in logged[0])

    export = lifecycle.export
    with monkeypatch.context() as patch:
        patch.setattr(lifecycle, "export", lambda *a: os.kill(os.getpid(), signal.SIGTERM) or export(*a))
        assert command.main(argv) == PREEMPTED_EXIT  # step 2 trained, validated and saved; its export stopped
    assert validated == [2] and committed_steps(tmp_path / "checkpoints") == [1, 2]
    assert not (tmp_path / "hf" / "config.json").exists()
    assert command.main(argv) == 0  # nothing left to train: the export
    assert (tmp_path / "hf" / "config.json").is_file() and validated == [2]
    for number, handler in handlers.items():
        signal.signal(number, handler)


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> list[dict]:
    """Four steps straight through on the 8 data shards: the run both resume tests are compared with."""
    return train(tmp_path_factory.mktemp("straight"), "trainer.total_steps=4")


def test_resume_continues_exactly(tmp_path, straight):
    train(tmp_path / "resumed", "trainer.total_steps=2")
    # a checkpoint interrupted mid-write must never be picked up
    (tmp_path / "resumed" / "checkpoints" / "3.orbax-checkpoint-tmp-1234").mkdir()
    resumed = train(tmp_path / "resumed", "trainer.total_steps=4")
    assert [row["step"] for row in resumed] == [1, 2, 3, 4]
    for a, b in zip(straight[2:], resumed[2:]):
        assert deterministic(a) == deterministic(b)


def test_resume_on_a_different_mesh_continues_as_the_run_would_have(tmp_path, straight):
    # step 2 of the four-step run: the learning rate is constant, so a run's steps do not depend on total_steps
    train(tmp_path / "moved", "trainer.total_steps=1", "mesh.data=8")
    rows = train(tmp_path / "moved", "trainer.total_steps=2", "mesh.data=2", "mesh.fsdp=4")
    assert [row["step"] for row in rows] == [1, 2]
    assert rows[1]["actor/skipped_updates"] == 0
    for name, value in deterministic(straight[1]).items():
        # float32: the same step's sums over 8 data shards and over 2 x 4 agree to rounding
        np.testing.assert_allclose(rows[1][name], value, rtol=1e-4, atol=1e-6, err_msg=name)


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jppo.train", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)


@pytest.mark.parametrize("command", ["jppo.train", "jppo.eval", "jppo.plan"])
def test_help_says_what_runs_without_a_config(capsys, command):
    import importlib

    with pytest.raises(SystemExit):
        importlib.import_module(command).parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "quickstart defaults" not in text  # without --config the run is not the quickstart
    assert "configs/quickstart.yaml" in text
    defaults, quickstart = load_config(None), load_config(QUICKSTART)
    stated_lr = re.search(r"actor\.optim\.lr=([0-9.e+-]+)\)", text)
    assert stated_lr is not None and float(stated_lr.group(1)) == defaults.actor.optim.lr
    assert defaults.data.task in text
    assert defaults.actor.optim.lr != quickstart.actor.optim.lr


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["actor.ppo_epoch=2"], "actor.ppo_epoch"),
        (["trainer.total_steps=ten"], "trainer.total_steps"),
        (["actor.policy_loss=vanila"], "actor.policy_loss='vanila'"),
        (["algorithm.adv_estimator=gea"], "algorithm.adv_estimator='gea'"),
        (["actor.kl_loss_type=k4"], "actor.kl_loss_type='k4'"),
        (["data.train_batch_size=30"], "does not divide data.train_batch_size=30"),
        # batch sizes in the prompts the user wrote, not the sequences the engine counts
        (["rollout.n=8", "actor.ppo_mini_batch_size=3"], "actor.ppo_mini_batch_size=3 (prompts) does not divide "
                                                         "data.train_batch_size=128"),
        (["rollout.n=2", "actor.ppo_mini_batch_size=2"], "actor.ppo_micro_batch_size=8 must be between 1 and the 4 "
                                                         "sequences per batch shard of a mini-batch "
                                                         "(actor.ppo_mini_batch_size=2 (prompts) x rollout.n=2"),
        (["actor.ppo_micro_batch_size=3"], "actor.ppo_micro_batch_size=3"),
        (["data.task=files", "data.train_files=/nonexistent/train.jsonl"],
         "data.train_files='/nonexistent/train.jsonl'"),
        (["model.path=/nonexistent/ckpt"], "model.path='/nonexistent/ckpt'"),
        (["mesh.data=3"], "mesh.data=3"),
        (["actor.policy_loss=gspo"], "actor.policy_loss='gspo' needs actor.loss_agg_mode='seq-mean-token-mean'"),
        # once crashes with a traceback (issue 17)
        (["actor.clip_ratio_c=0.5"], "actor.clip_ratio_c=0.5 is invalid: it must be > 1"),
        (["rollout.val_n=0"], "rollout.val_n=0 is invalid: it must be an integer >= 1"),
        (["data.task_options=[1,2]"], "data.task_options=[1,2]"),
        (["model.tokenizer=abc"], "model.tokenizer"),
    ],
)
def test_config_errors_are_one_line_with_exit_status_2(tmp_path, overrides, message):
    result = cli("--config", str(QUICKSTART), f"trainer.output_dir={tmp_path}", *overrides)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert message in lines[0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rollout_dtype_samples_with_the_same_parameters_in_that_dtype(dtype, tmp_path):
    """``rollout.dtype``: the sampler runs the policy's own parameters, computing in that dtype. In float32, as the
    trainer, its log-probs are the recomputed ``old_log_prob`` (no mismatch: KL 0, ratio 1 to float32 rounding of
    the two programs); in bfloat16 the rollout_corr metrics show the mismatch (|KL| ~1e-5 on this model: well
    above float32 rounding, ~1e-7, and below bfloat16's 2^-8 relative step, as a logit rounding error averages)."""
    rows = train(tmp_path, "trainer.total_steps=1", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4",
                 f"rollout.dtype={dtype}", config=GRPO)
    kl, ratio = rows[0]["rollout_corr/kl"], rows[0]["rollout_corr/ratio_mean"]
    if dtype == "float32":
        assert abs(kl) < 1e-7 and abs(ratio - 1) < 1e-6
    else:
        assert 1e-7 < abs(kl) < 1e-2 and abs(ratio - 1) > 1e-7  # k1 estimate: either sign on a small sample


def test_the_sampling_structure_differs_only_in_compute_dtype():
    from flax import nnx

    from jppo.models import CausalLM, ModelConfig, create_model
    from jppo.run.build import sampling_graphdef

    policy = create_model(CausalLM, ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1,
                                                num_heads=2, num_kv_heads=1, model_type="qwen2"))
    graphdef, params = nnx.split(policy, nnx.Param)
    cfg = load_config(QUICKSTART, ["rollout.dtype=bfloat16"])
    sampler_model = nnx.merge(sampling_graphdef(cfg, policy), params)
    assert sampler_model.config == dataclasses.replace(policy.config, dtype="bfloat16")
    # the same parameter arrays (no copy), and logits close to the float32 policy's at bfloat16's precision
    assert all(a is b for a, b in zip(jax.tree.leaves(nnx.state(sampler_model, nnx.Param)), jax.tree.leaves(params)))
    ids = jnp.arange(8, dtype=jnp.int32)[None]
    bf16, fp32 = np.asarray(sampler_model(ids), np.float32), np.asarray(policy(ids), np.float32)
    assert not np.array_equal(bf16, fp32)
    np.testing.assert_allclose(bf16, fp32, atol=0.05 * np.abs(fp32).max())
    default = nnx.merge(sampling_graphdef(load_config(QUICKSTART), policy), params)
    assert default.config == policy.config


def test_the_actor_s_mini_batches_do_not_depend_on_whether_a_critic_exists(tmp_path):
    """Same seed, same experience: the actor's update (two epochs of two shuffled mini-batches, so which rows share
    an optimizer step matters) is the same whether or not a critic updates before it in the step."""
    from jppo.run.collect import collect
    from jppo.run.learn import learn
    from jppo.runlog.timing import PhaseTimer

    cfg = load_config(QUICKSTART, [*SMALL, f"trainer.output_dir={tmp_path}", "mesh.data=1"])
    assert cfg.use_critic and cfg.actor.shuffle
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    state, collector, with_critic, _ = setup(cfg, mesh, build.load_inputs(cfg))
    state, experience, _ = collect(collector, state, PhaseTimer())
    copy = jax.tree.map(jnp.copy, state)  # the updates donate their state
    without_critic = dataclasses.replace(with_critic, critic_cfg=None, critic_step=None)
    alone, alone_metrics = learn(without_critic, copy, experience, PhaseTimer())
    both, both_metrics = learn(with_critic, state, experience, PhaseTimer())
    assert "critic/vf_loss" in both_metrics and "critic/vf_loss" not in alone_metrics
    for name, value in alone_metrics.items():
        assert both_metrics[name] == value, name
    actor_params = [jax.tree.leaves(jax.device_get(run.actor.params)) for run in (alone, both)]
    for a, b in zip(*actor_params):
        np.testing.assert_array_equal(a, b)  # the same compiled update on the same rows: bit for bit


def test_the_forward_passes_of_a_step_place_its_tokens_once(tmp_path, monkeypatch):
    """Old log-probs, reference log-probs and values all read the batch's tokens from one placement on the devices
    (each update then sends its own rows once: tests/test_engine_assemble.py). Counted where every placement of
    rows starts, :func:`jppo.engine.assemble.host_rows`; ``None`` asks for the token arrays alone."""
    from jppo.engine import assemble
    from jppo.run.collect import collect
    from jppo.runlog.timing import PhaseTimer

    asked = []
    host_rows = assemble.host_rows
    monkeypatch.setattr(assemble, "host_rows", lambda batch, per_token: asked.append(per_token) or host_rows(
        batch, per_token))
    cfg = load_config(QUICKSTART, [*SMALL, f"trainer.output_dir={tmp_path}", "mesh.data=1", "actor.use_kl_loss=true"])
    state, collector, _, _ = setup(cfg, make_mesh(1, 1, 1, devices=jax.devices()[:1]), build.load_inputs(cfg))
    timer = PhaseTimer()
    collect(collector, state, timer)
    assert {"old_log_prob", "ref_log_prob", "values"} <= set(timer.seconds)
    assert asked == [None]


def test_resume_with_other_ppo_epochs_keeps_the_learning_rate_schedule_s_place(tmp_path):
    """Step 2 after a resume with half the epochs: the cosine schedule is at training step 1 (of 4), as in a run
    that never changed (lr_t = lr * (1 + cos(pi t / 4)) / 2); the checkpoint counted 2 x 2 optimizer steps per
    training step, the resumed run counts 1 x 2."""
    schedule = ["actor.optim.lr_schedule=cosine", "actor.optim.decay_steps=4", "actor.optim.min_lr_ratio=0"]
    first = train(tmp_path, "trainer.total_steps=1", "actor.ppo_epochs=2", *schedule, config=GRPO)
    rows = train(tmp_path, "trainer.total_steps=2", "actor.ppo_epochs=1", *schedule, config=GRPO)
    lr = load_config(GRPO, []).actor.optim.lr
    assert [row["step"] for row in rows] == [1, 2] and first[0]["actor/lr"] == pytest.approx(lr, rel=1e-6)
    # float32 rates: to 1e-6
    assert rows[1]["actor/lr"] == pytest.approx(lr * (1 + math.cos(math.pi / 4)) / 2, rel=1e-6)


def test_resume_with_another_vocabulary_or_critic_is_refused_in_one_line(tmp_path):
    """A checkpoint of the quickstart (14-token vocabulary, a critic from the policy, hidden size 64), resumed with
    another task's vocabulary or a critic of another shape from critic.model_path: one line naming the key and both
    values, from the checkpoint's meta, before any model is built (an orbax traceback at restore before)."""
    from jppo.config import ConfigError
    from jppo.config.views import random_model_config
    from jppo.models import CausalLM, create_model, save_pretrained
    from jppo.run.checkpoint import CheckpointManager
    from jppo.run.lifecycle import read_resume, save

    cfg = load_config(QUICKSTART, [*SMALL, f"trainer.output_dir={tmp_path / 'run'}"])
    inputs = build.load_inputs(cfg)
    state = setup(cfg, make_mesh(*check_mesh(cfg, 1), devices=jax.devices()[:1]), inputs)[0]
    with CheckpointManager(tmp_path / "run" / "checkpoints") as manager:
        save(manager, state, cfg)  # step 0: what a run writes, with its record of the models
    checkpoints, source = tmp_path / "run" / "checkpoints", f"trainer.resume: checkpoint '{tmp_path}/run/checkpoints/0'"
    other = load_config(QUICKSTART, [*SMALL, f"trainer.output_dir={tmp_path / 'run'}", "data.task=add_small"])
    with pytest.raises(ConfigError) as refused:
        read_resume(other, checkpoints)
    assert str(refused.value) == (f"{source} was trained with model.vocab_size=14, but this config has "
                                  "model.vocab_size=15 (the vocabulary of the tokenizer 'builtin:add_small')")
    narrow = load_config(QUICKSTART, ["model.hidden_size=32"])
    save_pretrained(create_model(CausalLM, random_model_config(narrow, inputs.tokenizer), None, seed=0),
                    tmp_path / "critic")
    other = load_config(QUICKSTART, [*SMALL, f"trainer.output_dir={tmp_path / 'run'}",
                                     f"critic.model_path={tmp_path / 'critic'}"])
    with pytest.raises(ConfigError) as refused:
        read_resume(other, checkpoints)
    assert str(refused.value) == (f"{source} was trained with critic.model_path=None (a critic of "
                                  "critic.hidden_size=64), but this config has "
                                  f"critic.model_path='{tmp_path / 'critic'}' (a critic of critic.hidden_size=32)")
    assert read_resume(cfg, checkpoints).checkpoint == str(checkpoints / "0")  # the run's own config resumes
