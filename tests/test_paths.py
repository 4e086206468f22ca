"""Run outputs on cloud URIs: ``gs://bucket/run`` stays a URI (never a local folder named ``gs:``), and the logger,
plots, config and Hugging Face export write through it. A fake bucket stands in for Cloud Storage: epath's file
system calls on ``gs://`` paths are redirected into a temporary folder, so nothing touches the network."""

from __future__ import annotations

import json
import os

import pytest
from etils import epath
from etils.epath import testing as epath_testing

from jppo.config import ConfigError, load_config, save_config, views
from jppo.core import paths
from jppo.data import load_tokenizer
from jppo.models import CausalLM, ModelConfig, create_model, load_pretrained, save_pretrained
from jppo.run.checkpoint import committed_steps, resolve_resume
from jppo.run.export import export_policy
from jppo.runlog import GENERATIONS_DIR, METRICS_FILE, TENSORBOARD_DIR, RunLogger, read_metrics
from jppo.runlog.plot import plot_run

URI = "gs://bucket/run"


@pytest.fixture
def bucket(tmp_path, monkeypatch):
    """The fake ``gs://`` store (a folder); the test runs in another, empty folder, checked for strays."""
    store, work = tmp_path / "store", tmp_path / "work"
    store.mkdir(), work.mkdir()
    monkeypatch.chdir(work)

    def local(value):
        text = os.fspath(value)
        return str(store / text[len("gs://"):]) if text.startswith("gs://") else value

    def redirect(original, path, *args, **kwargs):
        args = [local(arg) if isinstance(arg, (str, os.PathLike)) else arg for arg in args]
        return original(local(path), *args, **kwargs)

    names = ("copy", "exists", "glob", "isdir", "listdir", "makedirs", "mkdir", "open", "remove", "rename",
             "replace", "rmtree", "stat", "walk")
    with epath_testing.mock_epath(**{name: redirect for name in names}):
        yield store / "bucket" / "run"
    assert list(work.iterdir()) == [], "a cloud path was written as a local folder"


def test_a_cloud_uri_stays_a_uri_and_a_local_path_becomes_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cloud = paths.run_path(URI) / "checkpoints"
    assert isinstance(cloud, epath.Path) and str(cloud) == "gs://bucket/run/checkpoints"
    assert paths.is_remote(URI) and not paths.is_remote("runs/gs:x") and not paths.is_remote(tmp_path)
    assert str(paths.run_path("runs/x") / "checkpoints") == str(tmp_path / "runs" / "x" / "checkpoints")
    assert list(tmp_path.iterdir()) == []


def test_a_checkpoint_named_by_uri_is_reported_by_its_uri(bucket):
    with pytest.raises(ValueError, match=r"trainer.resume='gs://bucket/run/checkpoints/3': no such checkpoint"):
        resolve_resume(f"{URI}/checkpoints/3", f"{URI}/checkpoints")
    assert resolve_resume("auto", f"{URI}/checkpoints") is None


def test_logger_writes_metrics_and_tensorboard_into_the_bucket_and_resumes_there(bucket):
    with RunLogger(URI, total_steps=3, progress_bar=False) as logger:
        logger.log_generations(1, [{"prompt": "1+1=", "response": "2"}])
        logger.log(1, {"reward/mean": 0.5})
        assert [r["step"] for r in read_metrics(f"{URI}/{METRICS_FILE}")] == [1]  # visible after each step
        generations = (bucket / GENERATIONS_DIR / "step_1.jsonl").read_text()
        assert json.loads(generations) == {"prompt": "1+1=", "response": "2"}
        logger.log(2, {"reward/mean": 0.25})
    with RunLogger(URI, total_steps=3, progress_bar=False, start_step=2) as logger:  # resumed after step 1
        logger.log(2, {"reward/mean": 0.75})
    records = [json.loads(line) for line in (bucket / METRICS_FILE).read_text().splitlines()]
    assert records == [{"step": 1, "reward/mean": 0.5}, {"step": 2, "reward/mean": 0.75}]
    events = sorted((bucket / TENSORBOARD_DIR).glob("events.out.tfevents.*"))
    assert len(events) == 2 and all(event.stat().st_size > 0 for event in events)


def test_plots_and_config_are_written_into_the_bucket(bucket):
    bucket.mkdir(parents=True)
    (bucket / METRICS_FILE).write_text("".join(json.dumps({"step": s, "reward/mean": s / 4}) + "\n" for s in (1, 2)))
    written = plot_run(URI)
    assert [str(path) for path in written][:1] == [f"{URI}/plots/reward.png"]
    assert (bucket / "plots" / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    cfg = load_config(None, ["trainer.total_steps=2"])
    save_config(cfg, f"{URI}/config.yaml")
    assert "total_steps: 2" in (bucket / "config.yaml").read_text()


def test_hf_export_writes_a_loadable_checkpoint_into_the_bucket(bucket):
    config = ModelConfig(vocab_size=10, hidden_size=8, intermediate_size=12, num_layers=1, num_heads=2, num_kv_heads=1)
    save_pretrained(create_model(CausalLM, config, seed=0), f"{URI}/hf")
    assert sorted(p.name for p in (bucket / "hf").iterdir()) == ["config.json", "model.safetensors"]
    assert load_pretrained(bucket / "hf").config.hidden_size == 8


def test_export_policy_writes_shards_tokenizer_and_generation_config_into_the_bucket(bucket):
    cfg = load_config(None, ["trainer.total_steps=2"])
    tokenizer = load_tokenizer(views.tokenizer_spec(cfg))
    model = create_model(CausalLM, views.random_model_config(cfg, tokenizer), seed=0)
    (bucket / "hf").mkdir(parents=True)
    (bucket / "hf" / "stale.safetensors").write_bytes(b"old")  # an earlier export, replaced as a whole
    files = export_policy(model, cfg, tokenizer, f"{URI}/hf", dtype="float32", max_shard_bytes=4096)
    written = sorted(p.name for p in (bucket / "hf").iterdir())
    assert written == sorted(files) and "model.safetensors.index.json" in written and "tokenizer.json" in written
    assert load_pretrained(bucket / "hf").config.hidden_size == model.config.hidden_size


def test_checkpoint_helpers_read_a_run_directory_by_its_uri(bucket):
    (bucket / "checkpoints").mkdir(parents=True)
    assert committed_steps(f"{URI}/checkpoints") == []
    with pytest.raises(ValueError, match=r"trainer.resume='gs://bucket/run': the run directory holds no complete"):
        resolve_resume(URI, f"{URI}/checkpoints")


def test_config_accepts_a_cloud_output_dir_and_refuses_what_cannot_be_written(bucket, monkeypatch):
    with pytest.raises(ConfigError, match=r"^trainer.output_dir='http://host/run': unsupported URI scheme http://"):
        load_config(None, ["trainer.output_dir=http://host/run"])
    monkeypatch.setattr("jppo.config.check.missing_backend", lambda value: None)  # as if gcsfs were installed
    assert load_config(None, [f"trainer.output_dir={URI}"]).trainer.output_dir == URI


def test_a_cloud_scheme_without_its_file_system_package_is_one_line(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert paths.missing_backend(URI) == "gs:// needs the gcsfs package (pip install gcsfs)"
    assert paths.missing_backend("runs/x") is None
