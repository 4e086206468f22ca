"""``python -m jppo.audit`` passes a contract-keeping config and exposes the legacy per-micro-batch mode."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

from jppo.audit import main
from jppo.preflight.audit import row_verdict
from jppo.preflight.audit_cuts import mesh_shapes

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "quickstart.yaml")
SMALL = ["data.train_batch_size=16", "actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=8",
         "actor.ppo_micro_batch_size=1", "critic.ppo_micro_batch_size=1"]


def test_mesh_shapes_cover_every_factorization_whose_shards_divide_the_batch():
    assert set(mesh_shapes(8, 8)) == {
        (1, 1, 8, 1), (1, 2, 4, 1), (2, 1, 4, 1), (1, 4, 2, 1), (2, 2, 2, 1), (4, 1, 2, 1), (1, 8, 1, 1), (2, 4, 1, 1),
        (4, 2, 1, 1), (8, 1, 1, 1),
        (4, 1, 1, 2), (2, 1, 2, 2),  # context parallel: the tokens of each row over two devices
    }
    assert (4, 1, 1, 1) not in mesh_shapes(4, 2) and (2, 1, 2, 1) in mesh_shapes(4, 2)
    assert (2, 1, 1, 2) in mesh_shapes(4, 2) and not any(shape[3] > 1 for shape in mesh_shapes(3, 3))


def test_a_row_beyond_rounding_after_the_first_step_is_decided_in_float64():
    assert row_verdict(2e-5, 0.0, 1e-5) == "outside"  # the first step: same parameters, nothing amplifies rounding
    assert row_verdict(3e-7, 1e-5, 1e-5) == "within"
    assert row_verdict(3e-7, 1.1e-4, 1e-5) == "float64" and row_verdict(0.0, 2e-9, 1e-9) == "float64"


def test_the_bitwise_audit_demands_every_row_exact(capsys):
    """trainer.deterministic=bitwise: the mode's cuts (fixed micro-batches) and meshes (data x fsdp), every row 0 on
    every column; a token budget or a tensor axis is not one of its rows."""
    meshes = "1x1x1x1,2x2x1x1"
    assert main(["--config", CONFIG, "--meshes", meshes, *SMALL, "trainer.deterministic=bitwise"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("actor ", "critic "))]
    assert len(rows) == 2 * (3 + 1) and not any("tokens<=" in row for row in rows)
    assert all(float(value) == 0 for row in rows for value in re.findall(NUMBER, row)[:3]), rows
    assert "jppo.audit: exact (trainer.deterministic=bitwise: every row bit for bit), 0 rows not exact" in out
    assert set(last_values(out).values()) == {0.0}


def last_values(out: str) -> dict[str, float]:
    lines = [line for line in out.strip().splitlines() if line.startswith("max_rel_")]
    return {line.split("=")[0]: float(line.split("=")[1]) for line in lines}


def test_audit_passes_the_quickstart_config(capsys):
    """The quick audit's meshes of all 8 devices; the one-device cuts are the README audit's (below, every cut of
    the full batch)."""
    assert main(["--config", CONFIG, "--quick", "--meshes", "8x1x1x1,2x2x2x1,4x1x1x2", *SMALL]) == 0
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    assert lines[-1].startswith("max_rel_metric_diff=") and lines[-2].startswith("max_rel_grad_diff=")
    values = last_values(out)
    assert values["max_rel_first_step_grad_diff"] <= 1e-5
    assert values["max_rel_grad_diff"] <= 1e-4 and values["max_rel_metric_diff"] <= 1e-4
    rows = [line for line in lines if line.startswith(("actor ", "critic "))]
    # (8,1,1,1) and (2,2,2,1): 2 cuts each; the context-parallel (4,1,1,2): the tight budget; for both models
    assert len(rows) == 2 * (2 + 2 + 1)
    assert any("tokens<=" in row and "(2, 2, 2, 1)" in row for row in rows)
    assert sum("(4, 1, 1, 2)" in row and "tokens<=" in row for row in rows) == 2
    # a whole training step: 16 prompts in mini-batches of 8, two epochs
    assert "4 actor optimizer steps, 4 critic" in lines[0]


def test_the_readme_audit_of_the_quickstart_passes_compiled_as_a_user_runs_it():
    """``python -m jppo.audit --config configs/quickstart.yaml`` as a user runs it: its full batch (128 sequences, 4
    optimizer steps per role), every cut on one device, compiled at XLA's default optimization level (not the
    suite's lowest: a subprocess). Adam's first update (about ``lr * g / |g|`` per entry) and the clipped value loss
    amplify the critic's float32 rounding after its first step to ~1e-4 between cuts (the old verdict failed this
    audit); the rows beyond float32's tolerance are decided in float64, where they agree to ~1e-13. The 8-device
    meshes are the other audits' here (the same programs, sharded)."""
    env = {**os.environ, "JAX_DISABLE_MOST_OPTIMIZATIONS": "0"}  # the suite's cache folder: conftest.py
    done = subprocess.run([sys.executable, "-m", "jppo.audit", "--config", CONFIG, "--meshes", "1x1x1x1"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert "4 actor optimizer steps, 4 critic" in lines[0] and "128 sequences" in lines[0]
    rows = [line for line in lines if line.startswith(("actor ", "critic "))]
    assert len(rows) == 2 * 5 and all(float(re.findall(NUMBER, row)[0]) <= 1e-5 for row in rows)
    wide = [float64_line(lines, row) for row in rows if float64_line(lines, row)]
    assert wide and all(max(map(float, re.findall(NUMBER, line))) <= 1e-9 for line in wide), wide
    assert f"decided in float64: {len(wide)} rows" in done.stdout and ", 0 rows outside" in done.stdout


NUMBER = r"\d\.\d+e[+-]\d+"  # the table's %.3e numbers; the mesh and cut columns hold only plain integers


def first_step_diffs(out: str, role: str) -> list[float]:
    """The "grad step 1" column of ``role``'s rows in the audit's table (the first of a row's three numbers)."""
    rows = [line for line in out.strip().splitlines() if line.startswith(f"{role} ")]
    return [float(re.findall(NUMBER, row)[0]) for row in rows]


def test_audit_reports_the_legacy_split_dependence_of_each_role(capsys):
    """Both roles in the legacy mode, in one audit: each role's updates come from its own loss on the same batch, so
    one run shows each role's split-dependence row by row, as one run per role did. The one-device cuts alone
    (``--meshes 1x1x1x1``) show it: the meshes' rows are what the other audits here check."""
    legacy = ["actor.normalization=per_micro_batch", "critic.normalization=per_micro_batch"]
    four = ["data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "critic.ppo_mini_batch_size=4", "mesh.data=4",
            "mesh.tensor=2"]  # the configured mesh must split a mini-batch too: 4 batch shards
    assert main(["--config", CONFIG, "--quick", "--meshes", "1x1x1x1", *SMALL, *four, *legacy]) == 1
    out = capsys.readouterr().out
    actor, critic = first_step_diffs(out, "actor"), first_step_diffs(out, "critic")
    # one device: fixed micro-batches of 4, 2 and 1, token budgets of the longest row and twice it
    assert len(actor) == len(critic) == 5
    assert all(" (1, 1, 1, 1) " in row for row in out.splitlines() if row.startswith(("actor ", "critic ")))
    # the critic's legacy mode inflates by K (up to 4 here); the actor's averages micro-batch means, which only
    # reweighs tokens: split-dependent, far beyond rounding, but not inflated
    assert max(critic) > 1.0 and max(actor) > 1e-3
    # the verdict is the worst row of either role
    assert f"{last_values(out)['max_rel_first_step_grad_diff']:.3e}" == f"{max(actor + critic):.3e}"


GRPO = ["critic.enable=false", "algorithm.adv_estimator=grpo", "rollout.n=2"]
# verl's sequence-level rejection, critic-free to keep the audit short (a critic's explained variance over the one
# token a rejection can leave a mini-batch is 0 under every cut: tests/test_metrics.py)
SEQ_RS = [*GRPO, "actor.rollout_correction.mode=seq_rs"]


@pytest.mark.parametrize("overrides, message", [
    (["rollout.val_n=0"], "rollout.val_n=0 is invalid"),
    (["actor.clip_ratio_c=0.5"], "actor.clip_ratio_c=0.5 is invalid"),
    (["data.task_options=[1,2]"], "data.task_options=[1,2]"),
    (["model.tokenizer=abc"], "model.tokenizer"),
    (["--meshes", "3x1x1x1", *SMALL], "--meshes='3x1x1x1' is invalid"),  # 3 batch shards of a mini-batch of 8
    (["--meshes", "2x2x2", *SMALL], "--meshes='2x2x2' is invalid"),
    (["--meshes", "4x4x1x1", *SMALL], "of at most 8 devices"),
])
def test_odd_arguments_are_refused_in_one_line(capsys, overrides, message):
    assert main(["--config", CONFIG, *overrides]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jppo.audit: error: ") and message in lines[0], lines


def rows_of(out: str, role: str, mesh: str) -> list[str]:
    return [line for line in out.strip().splitlines() if line.startswith(f"{role} ") and f" {mesh} " in line]


def float64_line(lines: list[str], row: str) -> str | None:
    """The "in float64" line printed under ``row``, if the audit decided the row in float64."""
    following = lines[lines.index(row) + 1] if lines.index(row) + 1 < len(lines) else ""
    return following if following.lstrip().startswith("in float64") else None


def test_audit_covers_rollout_correction_and_fails_on_any_metric_or_later_step(capsys, monkeypatch):
    """One audit of verl's sequence-level rejection (rows cleared before the cut, as collection does), with two
    dependences on the mesh that only show after the first step: the clip fraction off by 1e-2 on the 3-D mesh,
    and every optimizer step after the first off by 3e-5 on the context-parallel mesh (within the old "ten times the
    first step's tolerance" for later steps, so the audit passed it). Each is beyond float32's first-step tolerance,
    so it is decided in float64, where it stays: exactly those 3 rows fail the run; the rollout_corr/* metrics are
    compared and the one-device cuts audit clean (every mode's weights and metrics are split-invariant in
    test_rollout_correction; one audit run for all checks keeps this file's time down)."""
    import jax

    import jppo.preflight.audit as audit_module

    real = audit_module.run_updates

    def off_on_two_meshes(step, state, batch, cfg, mesh, rng):
        updated = real(step, state, batch, cfg, mesh, rng)
        if mesh.shape["tensor"] > 1 and mesh.shape["sequence"] == 1 and "actor/pg_clipfrac" in updated.metrics:
            updated.metrics["actor/pg_clipfrac"] += 1e-2
        if mesh.shape["sequence"] > 1:
            updated = updated._replace(gradients=jax.tree.map(lambda g: g.at[1:].multiply(1 + 3e-5), updated.gradients))
        return updated

    monkeypatch.setattr(audit_module, "run_updates", off_on_two_meshes)
    assert main(["--config", CONFIG, "--quick", "--meshes", "1x1x1x1,2x2x2x1,4x1x1x2", *SMALL, *SEQ_RS]) == 1
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    compared = [line for line in lines if line.startswith("compared (actor): ")]
    assert len(compared) == 1
    for name in ("rollout_corr/kl", "rollout_corr/ratio_mean", "rollout_corr/masked_fraction", "actor/pg_loss"):
        assert name in compared[0], name
    assert "rollout correction seq_rs" in lines[0]
    fraction = float(lines[0].split("rollout_corr/rejected_fraction ")[1].rstrip(")"))
    assert 0 < fraction < 1  # some rows rejected, not all
    assert "OUTSIDE tolerance" in out and ", 3 rows outside" in out
    values = last_values(out)
    assert values["max_rel_first_step_grad_diff"] <= 1e-5 and values["max_rel_metric_diff"] > 1e-3
    rows = [line for line in lines if line.startswith("actor ")]
    metric_off, later_off = rows_of(out, "actor", "(2, 2, 2, 1)"), rows_of(out, "actor", "(4, 1, 1, 2)")
    # one device: 5 cuts; the 3-D mesh: 2; the context-parallel mesh: 1 (the tight budget, --quick)
    assert len(rows) == 5 + 2 + 1 and len(metric_off) == 2 and len(later_off) == 1
    for row in rows_of(out, "actor", "(1, 1, 1, 1)"):  # clean: within, or rounding that float64 clears
        wide = float64_line(lines, row)
        assert wide is None or max(map(float, re.findall(NUMBER, wide))) <= 1e-9, (row, wide)
    for row in metric_off:
        wide = float64_line(lines, row)
        assert row.rstrip().endswith("actor/pg_clipfrac") and wide.rstrip().endswith("actor/pg_clipfrac"), (row, wide)
        assert float(re.findall(NUMBER, row)[2]) > 1e-3 and float(re.findall(NUMBER, wide)[2]) > 1e-3
    first, later = map(float, re.findall(NUMBER, later_off[0])[:2])
    assert first <= 1e-5 and 1e-5 < later <= 1e-4  # what the old verdict let through
    wide = float64_line(lines, later_off[0])
    assert float(re.findall(NUMBER, wide)[0]) <= 1e-9 and float(re.findall(NUMBER, wide)[1]) > 1e-5, wide


def test_an_error_inside_the_audit_is_one_line(capsys, tmp_path):
    """A critic checkpoint that cannot be read fails while the audit builds its models, after the config checks:
    still one line on stderr and exit status 2, no traceback."""
    (tmp_path / "config.json").write_text("{}")
    assert main(["--config", CONFIG, "--quick", *SMALL, f"critic.model_path={tmp_path}"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jppo.audit: error: ") and "config.json" in lines[0], lines
