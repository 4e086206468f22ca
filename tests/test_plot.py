"""Plots of a synthetic run: which PNGs appear, their grid sizes, skipped metrics, and the CLI's exit codes."""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jppo.plot import main
from jppo.runlog.plot import load_series, plot_run

REPO = Path(__file__).resolve().parents[1]
ALL_METRICS = (
    "reward/mean", "reward/max", "reward/min", "actor/pg_loss", "critic/vf_loss", "actor/entropy", "actor/kl_loss",
    "actor/ppo_kl", "response_length/mean", "response_length/max", "response_length/min",
)


def write_run(run_dir: Path, records: list[dict]) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    return run_dir


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])  # IHDR width, height


def full_run(steps: int) -> list[dict]:
    records = [
        {"step": step, **{name: math.sin(step + i) for i, name in enumerate(ALL_METRICS)}}
        for step in range(1, steps + 1)
    ]
    records[len(records) // 2]["actor/pg_loss"] = None  # a NaN at log time
    return records


def test_full_run_writes_every_figure_in_its_grid(tmp_path):
    run = write_run(tmp_path / "run", full_run(40))
    paths = plot_run(run)
    names = ["reward.png", "losses.png", "kl.png", "response_length.png", "summary.png"]
    assert paths == [run / "plots" / name for name in names]
    # 100 dpi, 5 x 3.2 inch panels plus 0.4 inch for the figure title: the size tells the grid.
    sizes = {path.name: png_size(path) for path in paths}
    assert sizes == {
        "reward.png": (500, 360), "kl.png": (500, 360), "response_length.png": (500, 360),
        "losses.png": (1000, 680), "summary.png": (1500, 680),
    }


def test_missing_metrics_are_skipped(tmp_path):
    run = write_run(tmp_path / "run", [{"step": 1, "reward/mean": 0.5, "actor/ppo_kl": None, "other": 2.0}])
    assert [p.name for p in plot_run(run)] == ["reward.png", "kl.png", "summary.png"]
    assert png_size(run / "plots" / "summary.png") == (1000, 360)  # reward and KL side by side

    unknown = write_run(tmp_path / "unknown", [{"step": 1, "other": 2.0}])
    assert plot_run(unknown) == [] and not (unknown / "plots").exists()


def test_series_are_sorted_by_step_with_nan_for_null(tmp_path):
    run = write_run(tmp_path / "run", [{"step": 3, "a": 1.5}, {"step": 1, "a": None, "b": 4}, {"step": 2, "a": 0.5}])
    series = load_series(run)
    np.testing.assert_array_equal(series["a"][0], [1, 2, 3])
    np.testing.assert_array_equal(series["a"][1], [np.nan, 0.5, 1.5])
    np.testing.assert_array_equal(series["b"][0], [1])
    assert "step" not in series


def test_bad_run_directories(tmp_path):
    with pytest.raises(FileNotFoundError, match="run directory .*absent.* does not exist"):
        plot_run(tmp_path / "absent")
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl in run directory"):
        plot_run(tmp_path)
    with pytest.raises(ValueError, match="holds no metrics"):
        plot_run(write_run(tmp_path / "empty", []))


def test_cli_exit_codes(tmp_path, capsys):
    run = write_run(tmp_path / "run", [{"step": 1, "reward/mean": 0.5}, {"step": 2, "reward/mean": 0.75}])
    assert main([str(run)]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines() == [str(run / "plots" / "reward.png"), str(run / "plots" / "summary.png")]
    assert err == ""

    assert main([str(write_run(tmp_path / "empty", []))]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and "holds no metrics" in err

    # The module entry point, as a user runs it.
    result = subprocess.run(
        [sys.executable, "-m", "jppo.plot", str(tmp_path / "absent")], cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2 and result.stdout == ""
    absent = str(tmp_path / "absent")
    assert result.stderr.splitlines() == [f"jppo.plot: error: run directory {absent!r} does not exist"]


def test_validation_before_training_is_plotted_from_step_zero(tmp_path):
    records = [{"step": 0, "val/reward/mean": 0.1, "val/accuracy": 0.0}] + full_run(4)
    records[-1].update({"val/reward/mean": 0.6, "val/accuracy": 0.5})
    run = write_run(tmp_path / "run", records)
    steps, values = load_series(run)["val/reward/mean"]
    assert steps.tolist() == [0, 4] and values.tolist() == [0.1, 0.6]
    assert load_series(run)["reward/mean"][0].tolist() == [1, 2, 3, 4]
    paths = plot_run(run)
    assert run / "plots" / "validation.png" in paths and png_size(run / "plots" / "validation.png") == (500, 360)
