"""``actor.old_log_prob``: where the PPO ratio's old log-probs come from.

When every row of a step is updated once, at the weights that sampled it (one epoch over one mini-batch), the
update's own log-probs ARE the old ones: ``auto`` then skips the forward pass before the update and takes them from
the update's own pass under stop-gradient. ``rollout`` takes the sampler's (verl's bypass mode). The engine cases run
in float64 on a tiny model (differences are summation order only); the trainer cases in float32 on the quickstart
PPO config with its critic.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import numpy as np
import pytest
from engine_cases import padded_inputs, ragged_batch, tiny_config
from flax import nnx

from jppo.config import ConfigError, check_mesh, load_config
from jppo.config.views import engine_view, old_log_prob_source
from jppo.core.errors import InvalidSetting
from jppo.core.settings import OptimConfig
from jppo.engine import ActorConfig, UpdateStep, actor_loss_fn, init_train_state, run_updates
from jppo.engine.config import check_old_log_prob
from jppo.losses import RolloutCorrection
from jppo.models.decoder import CausalLM
from jppo.models.sharding import create_model
from jppo.parallel.mesh import make_mesh
from jppo.run import build
from jppo.run.loop import run

ROOT = pathlib.Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
N = 16


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(2, 1, 1, devices=jax.devices()[:2])


def with_rollout_log_prob(seed: int = 0):
    """A ragged batch whose sampler log-probs differ from its old ones by token noise."""
    batch = ragged_batch(seed, n=N)
    noise = np.random.default_rng(seed + 1).normal(0, 0.2, batch.old_log_prob.shape)
    return dataclasses.replace(
        batch, rollout_log_prob=np.where(batch.response_attention, batch.old_log_prob + noise, 0.0)
    )


def actor_cfg(**kw) -> ActorConfig:
    base = dict(ppo_mini_batch_size=N, ppo_micro_batch_size=4, shuffle=False, entropy_coeff=0.01, use_kl_loss=True,
                kl_loss_coef=0.1, loss_scale_factor=6.0, optim=OptimConfig(name="sgd", lr=0.5, grad_clip=0.0))
    return ActorConfig(**(base | kw))


def initial(mesh):
    return nnx.split(create_model(CausalLM, tiny_config(), mesh, seed=0), nnx.Param)


def own_log_probs(model, batch) -> np.ndarray:
    """The model's float64 log-probs of the response tokens, from its full logits over the padded rows (an
    independent reference: the trainer's forward pass returns float32)."""
    ids, positions, segments = padded_inputs(batch)
    p, length = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    window = jax.nn.log_softmax(model(ids, positions, segments)[:, p - 1 : p - 1 + length], axis=-1)
    chosen = np.take_along_axis(np.asarray(window), np.asarray(ids)[:, p:, None], axis=-1)[..., 0]
    return np.where(batch.response_attention, chosen, 0.0)


STEPS: dict = {}  # one compiled update per config


def update(cfg: ActorConfig, batch, mesh):
    """Metrics and the accumulated gradient of one ``run_updates`` from the same initial tiny model."""
    graphdef, params = initial(mesh)
    state = init_train_state(params, cfg, mesh, keep_gradient=True)
    if cfg not in STEPS:
        STEPS[cfg] = UpdateStep(graphdef, actor_loss_fn(cfg), cfg, mesh, "actor", keep_gradient=True)
    _, metrics, gradients = run_updates(STEPS[cfg], state, batch, cfg, mesh, np.random.default_rng(0))
    return metrics, jax.device_get(gradients)


@pytest.fixture(scope="module")
def recomputed(mesh):
    """The engine with the old log-probs a forward pass at the initial weights gives (what collection computes)."""
    with jax.enable_x64(True):
        batch = with_rollout_log_prob()
        batch = dataclasses.replace(batch, old_log_prob=own_log_probs(nnx.merge(*initial(None)), batch))
        return batch, update(actor_cfg(), batch, mesh)


def test_the_update_s_own_log_probs_give_the_step_of_recomputed_ones(recomputed, mesh):
    """On-policy, stop-gradient(own log-probs) as the old ones: the same loss, gradient and metrics as with the
    pass before the update (float64; rtol 1e-12 covers the two programs' summation order)."""
    batch, (expected, expected_grad) = recomputed
    with jax.enable_x64(True):
        metrics, grad = update(actor_cfg(old_log_prob="update"), dataclasses.replace(batch, old_log_prob=None), mesh)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-15), grad, expected_grad)
    gap = metrics.pop("rollout/log_prob_abs_diff")  # measured here, since no pass before the update did
    assert metrics.keys() == expected.keys()
    for name in expected:
        np.testing.assert_allclose(metrics[name], expected[name], rtol=1e-12, atol=1e-15, err_msg=name)
    mask = batch.response_mask.astype(bool)
    np.testing.assert_allclose(gap, np.abs(batch.rollout_log_prob - batch.old_log_prob)[mask].mean(), rtol=1e-12)
    assert expected["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-15)  # on-policy: ratio 1 on every token


def test_the_sampler_s_log_probs_as_the_old_ones(recomputed, mesh):
    """``rollout``: the step of ``recompute`` given the sampler's log-probs as its old ones, and the
    ``rollout_corr/*`` metrics measure the sampler against the update's own log-probs (at the sampling weights on
    the first step: the recomputed ones)."""
    batch, (recompute_metrics, _) = recomputed
    with jax.enable_x64(True):
        metrics, grad = update(actor_cfg(old_log_prob="rollout"), batch, mesh)
        same, same_grad = update(actor_cfg(), dataclasses.replace(batch, old_log_prob=batch.rollout_log_prob), mesh)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-15), grad, same_grad)
    for name in ("actor/pg_loss", "actor/ppo_kl", "actor/pg_clipfrac", "actor/entropy", "actor/kl_loss"):
        np.testing.assert_allclose(metrics[name], same[name], rtol=1e-12, atol=1e-15, err_msg=name)
    assert same["rollout_corr/kl"] == pytest.approx(0.0, abs=1e-15)  # the old ones against themselves
    mask = batch.response_mask.astype(bool)
    d = (batch.rollout_log_prob - batch.old_log_prob)[mask]
    assert abs(d.mean()) > 1e-3  # the noise is there to be measured
    np.testing.assert_allclose(metrics["rollout_corr/kl"], d.mean(), rtol=1e-10)
    np.testing.assert_allclose(metrics["rollout_corr/ratio_mean"], np.exp(-d).mean(), rtol=1e-10)
    np.testing.assert_allclose(metrics["rollout_corr/kl"], recompute_metrics["rollout_corr/kl"], rtol=1e-10)
    np.testing.assert_allclose(metrics["rollout/log_prob_abs_diff"], np.abs(d).mean(), rtol=1e-10)


def test_the_engine_refuses_its_own_log_probs_off_policy_and_a_correction_over_the_sampler_s(mesh):
    off_policy = actor_cfg(old_log_prob="update", ppo_epochs=2)
    with pytest.raises(InvalidSetting, match="old_log_prob='update'.*2 epochs"):  # checked when the update is built
        UpdateStep(None, actor_loss_fn(off_policy), off_policy, mesh, "actor")
    with pytest.raises(InvalidSetting, match="old_log_prob='rollout'.*token_tis"):
        check_old_log_prob(actor_cfg(old_log_prob="rollout", rollout_correction=RolloutCorrection(mode="token_tis")))
    with jax.enable_x64(True), pytest.raises(ValueError, match="takes one optimizer step.*makes 2"):
        update(actor_cfg(old_log_prob="update", ppo_mini_batch_size=N // 2), with_rollout_log_prob(), mesh)


ON_POLICY = ["actor.ppo_epochs=1", "critic.ppo_epochs=1", "data.train_batch_size=16", "actor.ppo_mini_batch_size=16",
             "critic.ppo_mini_batch_size=16"]


@pytest.mark.parametrize("overrides,source", [
    ([], "recompute"),  # the quickstart: 2 epochs of 2 mini-batches
    (ON_POLICY, "update"),
    (ON_POLICY + ["actor.ppo_epochs=2"], "recompute"),
    (ON_POLICY + ["actor.ppo_mini_batch_size=8"], "recompute"),
    (ON_POLICY + ["algorithm.use_kl_in_reward=true"], "recompute"),  # KL(old || ref) enters the rewards
    (ON_POLICY + ["actor.rollout_correction.mode=seq_rs"], "recompute"),  # rows rejected at collection
    (ON_POLICY + ["algorithm.overlong_filter=true"], "recompute"),
    (ON_POLICY + ["actor.old_log_prob=recompute"], "recompute"),
    (["actor.old_log_prob=rollout"], "rollout"),
])
def test_auto_skips_the_pass_only_when_on_policy_and_nothing_reads_it_before(overrides, source, tmp_path):
    cfg = load_config(QUICKSTART, [*overrides, f"trainer.output_dir={tmp_path}"])
    assert old_log_prob_source(cfg) == source == engine_view(cfg, "actor").old_log_prob


@pytest.mark.parametrize("overrides,message", [
    (["actor.old_log_prob=fused"], "actor.old_log_prob='fused' is invalid: it must be one of auto, recompute, rollout"),
    (["actor.old_log_prob=rollout", "actor.rollout_correction.mode=token_tis"],
     "actor.old_log_prob='rollout' is invalid: it must be recompute with rollout_correction.mode='token_tis'"),
])
def test_config_errors_name_the_key(overrides, message, tmp_path):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        load_config(QUICKSTART, [*overrides, f"trainer.output_dir={tmp_path}"])


SMALL = ON_POLICY + ["actor.ppo_micro_batch_size=2", "critic.ppo_micro_batch_size=2", "trainer.val_every=0",
                     "trainer.save_every=0", "trainer.plots=false", "trainer.logger=[jsonl]",
                     "trainer.progress_bar=false"]


def train(tmp: pathlib.Path, *overrides: str) -> list[dict]:
    cfg = load_config(QUICKSTART, [*SMALL, f"trainer.output_dir={tmp}", *overrides])
    run(cfg, check_mesh(cfg, jax.device_count()), build.load_inputs(cfg))
    return [json.loads(line) for line in (tmp / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def ppo_runs(tmp_path_factory):
    """The quickstart's PPO with its critic, on-policy, 2 steps: with the pass before the update and without."""
    return {source: train(tmp_path_factory.mktemp(source), "trainer.total_steps=2", f"actor.old_log_prob={source}")
            for source in ("recompute", "auto")}


def test_a_ppo_run_without_the_pass_logs_what_it_logged_with_it(ppo_runs):
    """Sampling, critic, entropy, KL and every metric as with the pass: bitwise, but ``rollout/log_prob_abs_diff``,
    which collection sums in float64 and the update in float32 (rtol 1e-6: float32 sums of ~100 tokens)."""
    with_pass, without = ppo_runs["recompute"], ppo_runs["auto"]
    assert len(with_pass) == len(without) == 2
    for a, b in zip(with_pass, without):
        assert "timing/old_log_prob" in a and "timing/old_log_prob" not in b  # the pass was skipped
        assert "timing/values" in b and "critic/vf_loss" in b and "actor/entropy" in b
        gap = "rollout/log_prob_abs_diff"
        keys = {k for k in a if not k.startswith(("timing/", "perf/"))}
        assert keys == {k for k in b if not k.startswith(("timing/", "perf/"))} and gap in keys
        np.testing.assert_allclose(b[gap], a[gap], rtol=1e-6)
        assert {k: b[k] for k in keys - {gap}} == {k: a[k] for k in keys - {gap}}


def test_a_run_on_the_sampler_s_log_probs_measures_the_mismatch_the_pass_measured(ppo_runs, tmp_path):
    """``rollout``: no pass; on the first step the update's own log-probs are the recomputed ones, so it reports
    the same sampler/trainer mismatch (``rollout_corr/kl`` bitwise: the same float32 numbers; the gap as above)."""
    first = train(tmp_path, "trainer.total_steps=1", "actor.old_log_prob=rollout")[0]
    expected = ppo_runs["recompute"][0]
    assert "timing/old_log_prob" not in first
    assert first["reward/mean"] == expected["reward/mean"] and first["critic/vf_loss"] == expected["critic/vf_loss"]
    assert first["rollout_corr/kl"] == expected["rollout_corr/kl"]
    np.testing.assert_allclose(first["rollout/log_prob_abs_diff"], expected["rollout/log_prob_abs_diff"], rtol=1e-6)
