"""Experiment tracking of a training run: ``trainer.logger`` selects the sinks; wandb (offline here) records the
same metrics as ``metrics.jsonl`` and a table of the sampled validation responses; a missing wandb package is a
one-line config error; each validation writes its sample to ``generations/step_N.jsonl``."""

from __future__ import annotations

import glob
import json
import pathlib
import struct
import sys

import jax
import pytest

from jppo.config import ConfigError, check_mesh, load_config
from jppo.run import build
from jppo.run.loop import run

ROOT = pathlib.Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
SMALL = [
    "data.train_batch_size=16", "actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=8",
    "actor.ppo_micro_batch_size=1", "critic.ppo_micro_batch_size=1", "trainer.plots=false",
    "data.num_val_examples=8", "data.val_batch_size=8", "trainer.total_steps=2", "trainer.val_every=1",
    "trainer.val_before_train=true", "trainer.log_val_generations=3",
]


def train(tmp: pathlib.Path, *overrides: str) -> list[dict]:
    cfg = load_config(QUICKSTART, [*SMALL, f"trainer.output_dir={tmp}", *overrides])
    run(cfg, check_mesh(cfg, jax.device_count()), build.load_inputs(cfg))
    return [json.loads(line) for line in (tmp / "metrics.jsonl").read_text().splitlines()]


def wandb_history(path: str) -> dict[int, dict]:
    """The history rows of an offline run file (``run-ID.wandb``): wandb's record log, blocks of 32 KiB holding
    records with a 7-byte header (crc, length, kind: 1 whole, 2 first, 3 middle, 4 last) after a 7-byte file
    header; each record a ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2

    data, position, block, pending, history = pathlib.Path(path).read_bytes(), 7, 32768, b"", {}
    assert data[:4] == b":W&B"
    while position + 7 <= len(data):
        if block - position % block < 7:  # the rest of a block too small for a header is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if kind == 0:
            break
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record.FromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                row = history.setdefault(record.history.step.num, {})
                row.update({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
    return history


def test_wandb_offline_run_holds_the_metrics_and_generation_tables(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    rows = train(tmp_path / "run", "trainer.logger=[console,jsonl,wandb]", "trainer.experiment_name=tiny")
    [run_file] = glob.glob(str(tmp_path / "wandb_dir" / "wandb" / "offline-run-*" / "run-*.wandb"))
    history = wandb_history(run_file)
    assert sorted(history) == [row["step"] for row in rows] == [0, 1, 2]
    for row in rows:
        logged = history[row["step"]]
        for name, value in row.items():
            if name != "step" and value is not None:
                assert logged[name] == pytest.approx(value, rel=1e-6), name
        assert logged["val/generations/_type"] == "table-file" and logged["val/generations/nrows"] == 3
    run_id = (tmp_path / "run" / "wandb_run_id").read_text()
    assert run_file.endswith(f"run-{run_id}.wandb")


def test_missing_wandb_is_a_one_line_config_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now raises ImportError
    with pytest.raises(ConfigError) as error:
        load_config(QUICKSTART, [f"trainer.output_dir={tmp_path}", "trainer.logger=[console,wandb]"])
    message = str(error.value)
    assert "\n" not in message and message.startswith("trainer.logger=['console', 'wandb']")
    assert "pip install -e '.[wandb]'" in message
    with pytest.raises(ConfigError, match=r"trainer.logger='mlflow' is not valid; valid: console, jsonl"):
        load_config(QUICKSTART, [f"trainer.output_dir={tmp_path}", "trainer.logger=[console,mlflow]"])
    with pytest.raises(ConfigError, match=r"trainer.tensorboard"):  # the boolean is gone: trainer.logger replaces it
        load_config(QUICKSTART, [f"trainer.output_dir={tmp_path}", "trainer.tensorboard=false"])


def test_each_validation_writes_its_sample_of_generations(tmp_path, capsys):
    out = tmp_path / "run"
    rows = train(out, "trainer.logger=[console,jsonl]")
    assert [row["step"] for row in rows] == [0, 1, 2] and all("val/reward/mean" in row for row in rows)
    assert sorted(path.name for path in (out / "generations").iterdir()) == [f"step_{s}.jsonl" for s in (0, 1, 2)]
    for step in (0, 1, 2):
        lines = [json.loads(line) for line in (out / "generations" / f"step_{step}.jsonl").read_text().splitlines()]
        assert len(lines) == 3
        assert all(set(line) == {"prompt", "response", "reward", "finished"} for line in lines)
        assert all(0.0 <= line["reward"] <= 1.0 and line["prompt"].endswith("=") for line in lines)
    assert not (out / "tensorboard").exists()
    assert "step 0/2 | before training" in capsys.readouterr().err  # the console sink's summary lines

    quiet = tmp_path / "quiet"
    train(quiet, "trainer.logger=[jsonl]", "trainer.log_val_generations=0", "trainer.total_steps=1")
    assert (quiet / "metrics.jsonl").is_file() and not (quiet / "generations").exists()
