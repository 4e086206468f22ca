"""CI's rehearsal of the device check (``bash bench/device_check.sh --cpu``): the whole script within its 60-second
budget, every stage leaving valid JSON that says how it went, none of them failing; and the pieces that decide what
the stages measure (the block-count knob, the tokenizer of the real-size step)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
STAGES = ("versions", "attention", "quickstart", "grpo_step", "accelerator", "decode_blocks")
BUDGET = 60


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    out, work = tmp_path_factory.mktemp("device_check"), tmp_path_factory.mktemp("device_check_work")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env |= {"OUT": str(out), "DEVICE_CHECK_WORK": str(work / "scratch"), "DEVICE_CHECK_BUDGET": str(BUDGET)}
    started = time.monotonic()
    done = subprocess.run(["bash", str(ROOT / "bench" / "device_check.sh"), "--cpu"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=BUDGET + 60)
    return out, done, time.monotonic() - started, work / "scratch"


def test_cpu_mode_stays_in_its_budget_and_every_stage_writes_valid_json(rehearsal):
    out, done, wall, work = rehearsal
    assert done.returncode == 0, done.stderr[-3000:]
    assert wall < BUDGET + 20  # the boxes share the budget; each kill allows 5 s of grace at most, once
    summary = json.loads((out / "summary.json").read_text())
    assert summary["cpu_mode"] is True and summary["total_s"] <= BUDGET + 10
    for stage in STAGES:
        record = json.loads((out / f"{stage}.json").read_text())  # valid JSON, whatever happened
        assert record["stage"] == stage
        # a stage may run out of its box on a loaded machine (its JSON then says so), never fail
        assert record["status"] in ("ok", "timeout"), (stage, record.get("error"), record.get("log_tail"))
        assert summary[stage]["status"] == record["status"]
    assert not list(out.glob("**/*.safetensors")), "model files were written into the folder that travels back"
    assert not work.exists(), "the scratch folder (models, runs) was left behind"


def test_versions_stage_names_the_software_and_the_matmul_rate(rehearsal):
    out, _, _, _ = rehearsal
    versions = json.loads((out / "versions.json").read_text())
    if versions["status"] == "timeout":  # seconds at most on an idle machine; a machine loaded many times over
        pytest.skip("the versions stage ran out of its box on this machine (its JSON says so)")
    assert versions["backend"] == "cpu" and versions["bf16_matmul"]["tflops"] > 0
    assert versions["versions"]["jax"] and versions["versions"]["flax"]
    assert versions["python"].startswith("3.") and "XLA_FLAGS" in versions["environment"]


def test_attention_stage_covers_every_implementation(rehearsal):
    out, _, _, _ = rehearsal
    record = json.loads((out / "attention.json").read_text())
    if record["status"] == "timeout":
        pytest.skip("the attention stage ran out of its box on this machine (its JSON says so)")
    from jppo.models.config import ATTENTION_IMPLEMENTATIONS  # noqa: PLC0415

    assert record["implementations"] == list(ATTENTION_IMPLEMENTATIONS)
    for shape in record["shapes"].values():
        assert set(shape) == set(ATTENTION_IMPLEMENTATIONS)
        assert "skipped" in shape["cudnn"]  # a GPU's only
        for name in set(ATTENTION_IMPLEMENTATIONS) - {"cudnn"}:
            # float32 on CPU: the fused and reference softmaxes agree to a few float32 ulps of the largest value
            assert max(shape[name]["relative_error"].values()) < 1e-5, (name, shape[name])


def test_the_block_count_knob_is_found_or_the_module_constant_is_used():
    from bench.device_check.stages import block_knob  # noqa: PLC0415

    knob = block_knob()
    if knob is None:
        import jppo.models.layers as layers  # noqa: PLC0415

        assert isinstance(layers.RESPONSE_BLOCKS, int)  # what the stage sets while tracing each candidate
    else:
        assert knob[0] in ("SamplingParams", "ModelConfig") and "block" in knob[1]
    # attention's tile sizes (attention_block_q / _kv) are blocks too, but not the response cache's
    assert knob is None or not knob[1].startswith("attention_")


def test_real_size_tokenizer_has_the_models_whole_vocabulary(tmp_path):
    from bench.device_check.runs import write_tokenizer  # noqa: PLC0415
    from jppo.data.tokenizer import load_tokenizer  # noqa: PLC0415

    ids = write_tokenizer(tmp_path, 151936)
    assert ids["<|endoftext|>"] != ids["<|im_end|>"] and max(ids.values()) == 151935
    tokenizer = load_tokenizer(str(tmp_path))
    text = "Ana has 12 apples. #### 12"
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_bench_run_for_the_accelerator_alone_imports_no_torch():
    # an accelerator image has its own jax and often no torch: `bench.run --only accelerator` must not need it
    code = ("import sys, bench.run, bench.device_check.stages, bench.device_check.runs; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_a_training_stage_stopped_by_its_box_is_out_of_time_not_an_error(tmp_path):
    """The box ends a stage with SIGTERM; jppo.train, running in the stage's process, turns that signal into its
    resume status (75) instead of dying of it: the stage reports ``timeout`` (exit 124, as ``timeout`` does), not an
    error that would fail the check."""
    work, out = tmp_path / "work", tmp_path / "out"
    command = [sys.executable, "-m", "bench.device_check.runs", "quickstart", "--cpu", "--out", str(out)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "DEVICE_CHECK_WORK": str(work)}
    stage = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (work / "quickstart_run").exists() and stage.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)  # jppo.train makes its output folder once its signal handling is in place
    stage.terminate()
    _, stderr = stage.communicate(timeout=120)
    record = json.loads((out / "quickstart.json").read_text())
    assert (stage.returncode, record["status"]) == (124, "timeout"), (record, stderr[-2000:])
    assert "SIGTERM" in record["error"]
