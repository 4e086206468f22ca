"""``python -m jppo.eval``: the held-out prompts scored by the trainer's own validation, for a model given by the
config (random initialisation) and for a checkpoint of a short run; eval.json agrees with generations.jsonl, with
the trainer's logged validation, and with pass@k computed directly from the per-prompt rewards."""

from __future__ import annotations

import json
import math
import pathlib

import jax
import pytest

from jppo.config import check_mesh, load_config
from jppo.eval import main
from jppo.run import build
from jppo.run.loop import run

ROOT = pathlib.Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
# A few prompts, 4 sampled responses each (temperature 1: the responses of a prompt differ).
SMALL = [
    "data.train_batch_size=16", "actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=8",
    "actor.ppo_micro_batch_size=1", "critic.ppo_micro_batch_size=1", "trainer.plots=false",
    "trainer.logger=[jsonl]", "data.num_val_examples=12", "data.val_batch_size=8", "rollout.val_n=4",
    "rollout.val_temperature=1.0",
]


def read_eval(out: pathlib.Path) -> tuple[dict, list[dict]]:
    report = json.loads((out / "eval.json").read_text())
    return report, [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]


def direct_pass_at_k(generations: list[dict], k: int) -> float:
    """The mean over prompts of 1 - C(n - c, k) / C(n, k), c the prompt's responses with reward 1."""
    by_prompt: dict[int, list[float]] = {}
    for line in generations:
        by_prompt.setdefault(line["index"], []).append(line["reward"])
    values = []
    for rewards in by_prompt.values():
        n, c = len(rewards), sum(r >= 1.0 - 1e-6 for r in rewards)
        values.append(1.0 - math.comb(n - c, k) / math.comb(n, k))
    return sum(values) / len(values)


def test_eval_of_a_random_model_writes_consistent_metrics_and_generations(tmp_path, capsys):
    out = tmp_path / "eval"
    assert main(["--config", str(QUICKSTART), "--out", str(out), *SMALL, f"trainer.output_dir={tmp_path / 'run'}"]) == 0
    report, generations = read_eval(out)
    assert report["checkpoint"] is None and report["step"] == 0 and report["config"]["rollout"]["val_n"] == 4
    assert len(generations) == 12 * 4
    assert [(g["index"], g["sample"]) for g in generations] == [(i, s) for i in range(12) for s in range(4)]
    assert {"prompt", "response", "reward", "finished"} <= set(generations[0])
    assert all(g["prompt"].endswith("=") for g in generations)  # the task's prompts
    metrics = report["metrics"]
    rewards = [g["reward"] for g in generations]
    assert metrics["val/reward/mean"] == pytest.approx(sum(rewards) / len(rewards), rel=1e-6)
    assert len({g["response"] for g in generations}) > 1  # sampled, not one greedy string
    assert set(metrics) == {"val/reward/mean", "val/accuracy", "val/pass@2", "val/pass@4"}
    assert metrics["val/accuracy"] == pytest.approx(direct_pass_at_k(generations, 1), abs=1e-9)
    for k in (2, 4):
        assert metrics[f"val/pass@{k}"] == pytest.approx(direct_pass_at_k(generations, k), abs=1e-9)
    assert "jppo.eval: config model: val/reward/mean=" in capsys.readouterr().out


def test_eval_of_a_checkpoint_equals_the_trainers_validation_of_it(tmp_path):
    """A 2-step run validates at step 2 and saves checkpoint 2; evaluating that run directory reproduces the
    validation it logged, response for response (the logged sample is the first responses of the evaluation)."""
    run_dir = tmp_path / "run"
    overrides = [*SMALL, f"trainer.output_dir={run_dir}", "trainer.total_steps=2", "trainer.val_every=2",
                 "trainer.log_val_generations=5"]
    cfg = load_config(QUICKSTART, overrides)
    run(cfg, check_mesh(cfg, jax.device_count()), build.load_inputs(cfg))
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    assert logged["step"] == 2

    out = tmp_path / "eval"
    assert main(["--config", str(QUICKSTART), "--out", str(out), *overrides, f"trainer.resume={run_dir}"]) == 0
    report, generations = read_eval(out)
    assert report["checkpoint"] == str(run_dir / "checkpoints" / "2") and report["step"] == 2
    for name, value in report["metrics"].items():
        assert value == pytest.approx(logged[name], rel=1e-6, abs=1e-9), name
    sample = [json.loads(line) for line in (run_dir / "generations" / "step_2.jsonl").read_text().splitlines()]
    assert sample == [{k: g[k] for k in ("prompt", "response", "reward", "finished")} for g in generations[:5]]

    # the same checkpoint named directly, and the untrained model of the same config, for contrast
    direct = tmp_path / "direct"
    assert main(["--config", str(QUICKSTART), "--out", str(direct), *overrides,
                 f"trainer.resume={run_dir / 'checkpoints' / '2'}"]) == 0
    assert read_eval(direct)[0]["metrics"] == report["metrics"]


@pytest.mark.parametrize("overrides, message", [
    (["rollout.val_n=0"], "rollout.val_n=0"),
    (["data.task=files", "data.train_files={prompts}", "trainer.val_every=0",
      "model.tokenizer=builtin:reverse_digits"], "data.val_files is not set"),
    (["trainer.resume={missing}"], "trainer.resume="),
])
def test_bad_config_exits_2_with_one_line(tmp_path, capsys, overrides, message):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "12=", "answer": "21"}) + "\n")
    items = [item.format(prompts=prompts, missing=tmp_path / "missing") for item in overrides]
    assert main(["--config", str(QUICKSTART), f"trainer.output_dir={tmp_path / 'run'}", *items]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("jppo.eval: error: ") and "\n" not in error and message in error, error
    assert not (tmp_path / "run").exists()
