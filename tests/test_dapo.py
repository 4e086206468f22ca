"""DAPO's toolkit: soft overlong punishment, overlong filtering, dynamic sampling (group filtering)."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import numpy as np
import pytest
from engine_cases import ragged_batch

from jppo.config import ConfigError, check_mesh, load_config
from jppo.core.experience import Experience
from jppo.models.decoder import CausalLM
from jppo.rewards import overlong_penalty
from jppo.run import build
from jppo.run.filters import DynamicSamplingError, Scored, concat, kept_rows_only, sampling_metrics, varied_groups
from jppo.run.loop import run

ROOT = pathlib.Path(__file__).resolve().parents[1]
DAPO = ROOT / "configs" / "quickstart_dapo.yaml"
SMALL = ["data.train_batch_size=4", "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size=1",
         "trainer.val_every=0", "trainer.plots=false", "trainer.logger=[jsonl]", "trainer.progress_bar=false",
         "trainer.total_steps=2"]


def test_overlong_penalty_is_zero_then_falls_linearly_to_minus_the_factor():
    limit, buffer, factor = 10, 4, 0.5
    lengths = np.arange(limit + 1)
    expected = [0.0 if n <= limit - buffer else -factor * (n - (limit - buffer)) / buffer for n in lengths]
    np.testing.assert_allclose(overlong_penalty(lengths, limit, buffer, factor), expected, rtol=1e-6)
    assert overlong_penalty(np.array([limit]), limit, buffer, factor)[0] == pytest.approx(-factor)


@pytest.mark.parametrize("overrides,message", [
    (["reward.overlong_buffer.len=0"], "reward.overlong_buffer.len=0 must be >= 1"),
    (["reward.overlong_buffer.len=8"], "reward.overlong_buffer.len=8 must be >= 1 and < rollout.max_response_length=8"),
    (["reward.overlong_buffer.penalty_factor=-1"], "reward.overlong_buffer.penalty_factor=-1.0 must be >= 0"),
    (["algorithm.filter_groups.metric=acc"], "algorithm.filter_groups.metric='acc' is not valid"),
    (["algorithm.filter_groups.max_num_gen_batches=-1"], "algorithm.filter_groups.max_num_gen_batches=-1"),
    (["rollout.n=1"], "rollout.n=1"),
])
def test_dapo_settings_are_validated_with_one_line_errors(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")) as error:
        load_config(DAPO, overrides)
    assert "\n" not in str(error.value)


def test_filter_groups_is_refused_with_several_processes():
    with pytest.raises(ConfigError, match="algorithm.filter_groups.enable=True runs in one process"):
        check_mesh(load_config(DAPO, []), 8, 2)


@pytest.mark.parametrize("mesh_shape,micro", [((1, 1, 1), 16), ((1, 1, 1), 4), ((8, 1, 1), 1)])
def test_overlong_filter_trains_as_if_the_truncated_rows_were_not_there(mesh_shape, micro):
    """The gradient with truncated rows masked equals the from-scratch gradient of the batch without them, for any
    micro-batch count and mesh: the normalizers count the kept rows' tokens over the whole mini-batch."""
    from test_engine_update import actor_cfg, engine_step, mesh_of, reference_step, tiny_config  # noqa: PLC0415

    from jppo.models.sharding import create_model  # noqa: PLC0415

    with jax.enable_x64(True):
        batch = ragged_batch(0)
        finished = np.random.default_rng(1).random(16) < 0.6
        finished[3] = False
        filtered = dataclasses.replace(batch, response_mask=kept_rows_only(batch.response_mask, finished))
        cfg = actor_cfg(ppo_micro_batch_size=micro)
        _, metrics, gradient = engine_step(CausalLM, cfg, mesh_of(mesh_shape), filtered)
        kept = batch.take(np.flatnonzero(finished))
        model = create_model(CausalLM, tiny_config(), None, seed=0)
        _, grads, loss, _ = reference_step(
            model, kept, dataclasses.replace(cfg, ppo_mini_batch_size=len(kept.response_mask)), 6.0
        )
        jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-9, atol=1e-14),
                     jax.device_get(gradient), jax.device_get(grads))


def test_varied_groups_keeps_groups_whose_values_differ_in_order_of_appearance():
    values = np.array([1, 1, 0, 1, 0, 0, 2, 2, 1, 1, 1, 1.5])
    groups = np.repeat([5, 1, 7, 0, 2, 3], 2)
    assert varied_groups(values, groups).tolist() == [1, 3]


def _scored(prompt_width: int, groups: int, n: int, offset: float) -> Scored:
    rows = groups * n
    prompt_mask = np.zeros((rows, prompt_width), bool)
    prompt_mask[:, -1] = True
    exp = Experience(
        prompt_ids=np.where(prompt_mask, 3, 0), prompt_mask=prompt_mask, response_ids=np.ones((rows, 2), np.int32),
        response_mask=np.ones((rows, 2), bool), rollout_log_prob=np.full((rows, 2), offset, np.float32),
        group_ids=np.repeat(np.arange(groups), n),
    )
    values = np.arange(rows, dtype=np.float32) + offset
    return Scored(exp, [f"ex{offset}-{g}" for g in range(groups)], [[g] for g in range(groups)],
                  [str(v) for v in values], [True] * rows, values, values)


def test_selected_and_joined_groups_keep_their_rows_and_are_renumbered():
    a, b = _scored(2, 3, 2, 0.0), _scored(4, 2, 2, 100.0)
    joined = concat([a.groups(np.array([2, 0])), b.groups(np.array([1]))], pad_id=0)
    assert joined.exp.group_ids.tolist() == [0, 0, 1, 1, 2, 2]
    assert joined.examples == ["ex0.0-2", "ex0.0-0", "ex100.0-1"]
    assert joined.scores.tolist() == [4, 5, 0, 1, 102, 103]
    assert joined.exp.prompt_ids.shape == (6, 4) and joined.exp.prompt_mask.sum(axis=1).tolist() == [1] * 6
    assert joined.exp.prompt_mask[:, -1].all()  # still left-padded
    assert joined.row_examples[4] == "ex100.0-1"


def test_kept_fraction_counts_the_groups_kept_not_those_that_varied():
    """Two batches of 4 prompts: 3 groups vary in the first, 4 in the second, of which 1 is still needed."""
    metrics = sampling_metrics([3, 4], batch_size=4)
    assert metrics == {"filter_groups/num_gen_batches": 2.0, "filter_groups/varied_fraction": 7 / 8,
                       "filter_groups/kept_fraction": 4 / 8}
    assert sampling_metrics([4], batch_size=4)["filter_groups/kept_fraction"] == 1.0


def train(tmp: pathlib.Path, *overrides: str) -> list[dict]:
    cfg = load_config(DAPO, [*SMALL, f"trainer.output_dir={tmp}", *overrides])
    run(cfg, check_mesh(cfg, jax.device_count()), build.load_inputs(cfg))
    return [json.loads(line) for line in (tmp / "metrics.jsonl").read_text().splitlines()]


def test_dapo_smoke_keeps_a_full_batch_of_varied_groups_and_advances_the_data_by_what_it_sampled(tmp_path, monkeypatch):
    import jppo.run.loop as train_module  # noqa: PLC0415

    seen = []
    real = train_module.learn

    def spy(learner, state, experience, timer):
        seen.append((int(np.asarray(state.data_position)), experience))
        return real(learner, state, experience, timer)

    monkeypatch.setattr(train_module, "learn", spy)
    rows = train(tmp_path, "algorithm.overlong_filter=true")
    assert len(rows) == 2 and all(np.isfinite(row["actor/pg_loss"]) for row in rows)
    gen_batches = [row["filter_groups/num_gen_batches"] for row in rows]
    for (position, exp), total in zip(seen, np.cumsum(gen_batches)):
        assert position == 4 * total  # every sampled prompt is consumed, kept or not
        assert exp.response_mask.shape[0] == 4 * 8  # train_batch_size x n
        rewards = exp.token_rewards.sum(axis=1)
        assert all(np.ptp(rewards[exp.group_ids == g]) > 0 for g in range(4))
    for row in rows:
        # every batch is drawn at train_batch_size prompts and exactly that many groups are kept
        assert row["filter_groups/kept_fraction"] == 1 / row["filter_groups/num_gen_batches"]
        assert row["filter_groups/kept_fraction"] <= row["filter_groups/varied_fraction"] <= 1


def test_dynamic_sampling_stops_with_an_error_after_max_num_gen_batches(tmp_path):
    """reward.kind=none scores every response 0 (no overlong shaping): no group ever varies."""
    with pytest.raises(DynamicSamplingError, match="2 prompt batches gave 0 of data.train_batch_size=4"):
        train(tmp_path, "reward.kind=none", "reward.overlong_buffer.enable=false",
              "algorithm.filter_groups.max_num_gen_batches=2")
