"""rollout.engine: vllm in the training process against the real vLLM (its CPU build here): the same tokens as
jppo's sampler when greedy, the trainer's log-probs of its samples, weights pushed before the next generation, short
off-policy runs, and the settings it refuses (vLLM on a server of its own: tests/test_vllm_servers.py).

One engine serves the whole module (vLLM's import and start take a minute or two on the CPU; a run with the same
model shape reuses the process's engine, :func:`jppo.rollout.vllm_engine.start`). The policy is the quickstart
GRPO's, 128 wide with 4 heads: head size 32, the smallest vLLM's CPU attention takes. Without vLLM installed the
module is skipped, unless ``JPPO_REQUIRE_VLLM=1`` (CI's ``.ci/run`` sets it: there the tests must run).
"""

import dataclasses
import json
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from vllm_cases import GRPO, ROOT, VLLM, Setup, moved, require_vllm, started, trainer_log_probs

from jppo.config import ConfigError, check_mesh, load_config
from jppo.config.views import sampling_params
from jppo.rollout import JppoEngine, vllm_engine
from jppo.run import build

require_vllm()


@pytest.fixture(scope="module")
def setup():
    return started(VLLM)


def samplers(s: Setup, **kind):
    """jppo's sampler and vLLM's, with the same sampling settings."""
    params = sampling_params(s.cfg, s.tokenizer, **kind)
    graphdef, bucket = s.models.actor.graphdef, s.cfg.rollout.prompt_bucket
    return (JppoEngine(None).sampler(graphdef, s.tokenizer.pad_id, s.mesh, params, bucket),
            s.engine.sampler(graphdef, s.tokenizer.pad_id, s.mesh, params, bucket))


def test_greedy_responses_equal_jppo_samplers(setup):
    jppo, vllm = samplers(setup, greedy_baseline=True)
    weights = setup.models.actor.params
    key = jax.random.key(0)
    ours, theirs = jppo(weights, setup.prompts, key), vllm(weights, setup.prompts, key)
    for field in ("prompt_ids", "prompt_mask", "response_mask", "response_ids", "group_ids"):
        np.testing.assert_array_equal(getattr(theirs, field), getattr(ours, field), err_msg=field)
    assert theirs.response_mask.any(axis=1).all()
    gap = np.abs(theirs.rollout_log_prob - ours.rollout_log_prob)[ours.response_mask]
    print("greedy log-prob gap vLLM vs jppo sampler: max", gap.max())
    assert gap.max() < 1e-5  # float32 rounding of the same model in two libraries (measured: 6e-7)


def test_sampled_log_probs_match_the_trainers_recomputation(setup):
    _, vllm = samplers(setup)
    weights = setup.models.actor.params
    exp = vllm(weights, setup.prompts, jax.random.key(1))
    assert exp.response_ids.shape == (len(setup.prompts) * setup.cfg.rollout.n, setup.cfg.rollout.max_response_length)
    mask = exp.response_mask.astype(bool)
    gap = np.abs(exp.rollout_log_prob - trainer_log_probs(setup, weights, exp))[mask]
    print("sampled log-prob gap vLLM vs trainer: max", gap.max(), "mean", gap.mean())
    assert gap.max() < 1e-5  # float32 rounding (measured: max 6e-7, mean 1.3e-7)


def test_a_weight_push_is_visible_in_the_next_generation(setup):
    jppo, vllm = samplers(setup, greedy_baseline=True)
    before = setup.models.actor.params
    after = moved(before, 2)  # another policy: every weight moved by noise 5x the initial scale (0.02)
    key = jax.random.key(0)
    old = vllm(before, setup.prompts, key)
    assert not setup.engine.push(before)  # the arrays it holds: nothing to push
    new, reference = vllm(after, setup.prompts, key), jppo(after, setup.prompts, key)
    assert setup.engine.push_seconds > 0
    assert not np.array_equal(new.response_ids, old.response_ids)  # the change shows
    np.testing.assert_array_equal(new.response_ids, reference.response_ids)
    np.testing.assert_array_equal(new.response_mask, reference.response_mask)


def test_with_lora_the_merged_weights_are_pushed(setup):
    cfg = load_config(GRPO, VLLM + ["actor.lora.rank=4", "actor.lora.alpha=8"])
    models = build.models(cfg, setup.tokenizer, setup.mesh)
    assert build.rollout_engine(cfg, models.policy) is setup.engine  # same architecture: the process's engine
    adapters = moved(models.actor.params, 3, scale=0.3)  # the adapters (B starts at 0: make them count)
    weights = nnx.merge_state(models.actor.frozen, adapters)  # what collection samples with (TrainState.weights)
    graphdef, bucket = build.sampling_graphdef(cfg, models.policy), cfg.rollout.prompt_bucket
    params = sampling_params(cfg, setup.tokenizer, greedy_baseline=True)
    jppo = JppoEngine(None).sampler(graphdef, setup.tokenizer.pad_id, setup.mesh, params, bucket)
    vllm = setup.engine.sampler(graphdef, setup.tokenizer.pad_id, setup.mesh, params, bucket)
    key = jax.random.key(0)
    ours, theirs, base = (jppo(weights, setup.prompts, key), vllm(weights, setup.prompts, key),
                          jppo(nnx.merge_state(models.actor.frozen, models.actor.params), setup.prompts, key))
    assert not np.array_equal(ours.response_ids, base.response_ids)  # the adapters change the policy
    np.testing.assert_array_equal(theirs.response_ids, ours.response_ids)
    np.testing.assert_array_equal(theirs.response_mask, ours.response_mask)


def test_one_step_off_policy_with_vllm_does_not_depend_on_the_thread(setup, tmp_path, monkeypatch):
    """``trainer.off_policy_steps=1``: vLLM samples step t + 1's batch on a thread beside step t's update; the same
    run with the generation in turn logs the same numbers, bit for bit: the schedule, not the timing, decides which
    weights sample which batch (the module's engine serves both runs, pushed before every generation)."""
    import jppo.run.loop as loop

    def three_steps(out: pathlib.Path) -> list[dict]:
        cfg = load_config(GRPO, VLLM + [
            "trainer.off_policy_steps=1", "trainer.total_steps=3", "trainer.val_every=0", f"trainer.output_dir={out}",
            "trainer.logger=[jsonl]", "trainer.plots=false", "trainer.progress_bar=false",
        ])
        loop.run(cfg, check_mesh(cfg, len(jax.devices())), build.load_inputs(cfg))
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        timing = ("timing/", "perf/", "async/train_wait_s", "async/rollout_wait_s")
        return [{k: v for k, v in row.items() if not k.startswith(timing)} for row in rows]

    overlap, chosen = loop.can_overlap, []
    monkeypatch.setattr(loop, "can_overlap", lambda collector: chosen.append(overlap(collector)) or chosen[-1])
    beside = three_steps(tmp_path / "beside")
    monkeypatch.setattr(loop, "can_overlap", lambda collector: False)
    in_turn = three_steps(tmp_path / "in-turn")
    assert chosen == [True]  # vLLM in one process, no reward model: the first run generated on the thread
    assert [row["async/staleness"] for row in beside] == [0.0, 1.0, 1.0]
    assert beside == in_turn
    # step 1 is on-policy: the engine samples what the trainer computes, to float32 rounding (the learning run is
    # tests/test_vllm_servers.py's, on a server)
    assert abs(beside[0]["rollout_corr/kl"]) < 1e-5 and beside[0]["rollout/log_prob_abs_diff"] < 1e-5


def test_bad_vllm_settings_are_one_line_before_anything_starts():
    for value in ("0.0", "1.5"):
        with pytest.raises(ConfigError, match=rf"^rollout.vllm.gpu_memory_utilization={value} is invalid: it must be "
                                              r"in \(0, 1\]$"):
            load_config(GRPO, VLLM + [f"rollout.vllm.gpu_memory_utilization={value}"])
    with pytest.raises(ConfigError, match=r"head size 8 \(model.hidden_size / model.num_heads\)"):
        load_config(GRPO, ["rollout.engine=vllm"])  # the quickstart's 64 wide, 8 heads
    with pytest.raises(ConfigError, match="max_position_embeddings=8, which vLLM refuses"):
        load_config(GRPO, VLLM + ["model.max_position_embeddings=8"])


def test_without_vllm_installed_the_command_says_how_to_install_it():
    code = ("import sys; sys.modules['vllm'] = None; from jppo.train import main; "
            f"sys.exit(main(['--config', {str(GRPO)!r}, *{VLLM!r}]))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"jppo.train: error: rollout.engine='vllm' needs vLLM: {vllm_engine.INSTALL}; or rollout.engine=jppo"]


def test_a_policy_with_experts_is_served_and_its_experts_pushed(setup):
    """The MoE quickstart's policy (layer 0 dense, layer 1 with 8 experts, top 2) at head size 32 on a vLLM engine
    of its own (the module's dense engine is shut down for it; the test after this one starts its own): vLLM's
    sampled log-probs are the trainer's (float32), and stay so after pushes of other weights (the router and every
    expert moved by 5x their initial scale) and of the first ones back: each expert reaches vLLM under its Hugging
    Face name and the CPU kernel computes with it (jppo.rollout.vllm_engine.repack_cpu_experts; without it the gap
    after a push is 0.12 on average, 1.1 at most)."""
    cfg = load_config(ROOT / "configs" / "quickstart_moe.yaml", VLLM)
    models = build.models(cfg, setup.tokenizer, setup.mesh)
    engine = build.rollout_engine(cfg, models.policy)
    assert engine is not setup.engine and models.policy.config.sparse_layers == (1,)
    moe = dataclasses.replace(setup, cfg=cfg, models=models, engine=engine)
    vllm = samplers(moe)[1]
    before = models.actor.params
    after = moved(before, 2)
    for weights in (before, after, before):
        exp = vllm(weights, setup.prompts, jax.random.key(1))
        mask = exp.response_mask.astype(bool)
        assert np.abs(exp.rollout_log_prob - trainer_log_probs(moe, weights, exp))[mask].max() < 1e-5
    assert engine.push_seconds > 0


def test_an_engine_vllm_cannot_start_is_one_line_and_exit_2(tmp_path, capsys):
    """A KV cache too small for one request: vLLM refuses at start-up, before training (the module's last test:
    the process's engine is shut down for it)."""
    from jppo.train import main

    rc = main(["--config", str(GRPO), *VLLM, "rollout.vllm.kv_cache_memory_bytes=1024",
               f"trainer.output_dir={tmp_path}", "trainer.logger=[jsonl]"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert lines[-1].startswith(
        "jppo.train: error: rollout.engine='vllm' could not start on the policy (Qwen2, head size 32): ")
    assert not (tmp_path / "metrics.jsonl").exists()
