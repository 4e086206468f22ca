"""``python -m jppo.audit`` passes a contract-keeping config and exposes the legacy per-micro-batch mode."""

import pathlib

import pytest

from jppo.audit import main, mesh_shapes

CONFIG = str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml")
SMALL = ["data.train_batch_size=16", "actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=8",
         "actor.ppo_micro_batch_size=1", "critic.ppo_micro_batch_size=1"]


def test_mesh_shapes_cover_every_factorization_whose_shards_divide_the_batch():
    assert set(mesh_shapes(8, 8)) == {
        (1, 1, 8), (1, 2, 4), (2, 1, 4), (1, 4, 2), (2, 2, 2), (4, 1, 2), (1, 8, 1), (2, 4, 1), (4, 2, 1), (8, 1, 1)
    }
    assert (4, 1, 1) not in mesh_shapes(4, 2) and (2, 1, 2) in mesh_shapes(4, 2)


def test_audit_passes_the_quickstart_config(capsys):
    assert main(["--config", CONFIG, "--quick", *SMALL]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    value = float(lines[-1].removeprefix("max_rel_grad_diff="))
    assert value <= 1e-5
    rows = [line for line in lines if line.startswith(("actor ", "critic "))]
    # one device: 5 cuts; (8,1,1) and (2,2,2): 2 cuts each; for both models
    assert len(rows) == 2 * (5 + 2 + 2)
    assert any("tokens<=" in row and "(2, 2, 2)" in row for row in rows)


def test_audit_reports_the_legacy_inflation(capsys):
    assert main(["--config", CONFIG, "--quick", *SMALL, "actor.normalization=per_micro_batch"]) == 1
    out = capsys.readouterr().out
    assert float(out.strip().splitlines()[-1].removeprefix("max_rel_grad_diff=")) > 0.1
