"""The benchmark suite: CI's smoke run of ``python -m bench.run --quick`` (keys and finite values, never times),
the PyTorch peer model against jppo's decoder, and the pure helpers (FLOP count, peak table, timing order,
end-to-end bookkeeping)."""

import json
import math
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import bench
from bench import accelerator, async_rl, end_to_end, peers, report, trl_alone, tunix_side
from bench import run as bench_run
from bench.timing import time_side_by_side
from bench.torch_decoder import TorchCausalLM
from bench.trl_side import per_step_seconds
from jppo.config.views import old_log_prob_source
from jppo.models import CausalLM, ModelConfig, create_model

ROOT = pathlib.Path(__file__).resolve().parents[1]

REQUIRED = (
    "accumulation_overhead_k8", "normalization_overhead", "update_vs_torch_tiny", "update_vs_torch_small",
    "sampler_vs_recompute", "sampler_vs_transformers", "rollout_vs_transformers_gsm8k_shape",
    "rollout_useful_slot_fraction", "rollout_continuous_vs_all_rows", "rollout_shared_prefix_memory_ratio",
)
TRL_KEYS = ("e2e_vs_trl_grpo", "e2e_vs_trl_grpo_quickstart", "e2e_vs_trl_grpo_gsm8k_shape")
TUNIX_KEYS = ("e2e_vs_tunix_grpo_quickstart", "e2e_vs_tunix_grpo_gsm8k_shape")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One quick run of the whole suite, accelerator code on its CPU stand-in with made-up peaks (so MFU and the
    roofline fraction are computed), in a fresh process: the suite's own JAX set-up, not this session's 8 devices."""
    out = tmp_path_factory.mktemp("bench")
    command = [
        sys.executable, "-m", "bench.run", "--quick", "--out", str(out), "--accelerator", "stand-in",
        "--peak-tflops", "1", "--bandwidth-gbs", "100",
    ]
    # CI does not install TRL or Tunix: the run must pass without them (hidden here, whether or not this venv has them)
    env = os.environ | {peers.HIDE_TRL_ENV: "1", tunix_side.HIDE_TUNIX_ENV: "1"}
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((out / "results.json").read_text()), (out / "results.md").read_text()


def test_quick_run_reports_every_headline_ratio_finite(quick_run):
    results, _ = quick_run
    for key in REQUIRED + ("e2e_seconds_per_step", "accelerator_mfu", "accelerator_decode_vs_roofline"):
        assert isinstance(results[key], float) and math.isfinite(results[key]) and results[key] > 0, key
        assert key in results["ratio_meanings"]
    assert "time_to_target_s" in results  # null in quick mode: three steps never reach the target
    for key in TRL_KEYS + TUNIX_KEYS:  # null without TRL and Tunix, with the reasons
        assert key in results["ratio_meanings"] and results[key] is None, key
    assert peers.HIDE_TRL_ENV in results["e2e_vs_trl_grpo_reason"]
    assert tunix_side.HIDE_TUNIX_ENV in results["e2e_vs_tunix_grpo_reason"]
    assert results["mode"] == "quick"
    assert set(results["benchmarks"]) == set(bench_run.ORDER)


def test_quick_run_details_are_consistent(quick_run):
    results, _ = quick_run
    details = results["benchmarks"]
    for size in ("tiny", "small"):
        losses = details["update_vs_torch"][size]["first_pg_loss"]
        # same weights, batch and loss in float32; only summation order differs
        np.testing.assert_allclose(losses["jppo"], losses["torch"], rtol=1e-4, atol=1e-6)
    phases = details["end_to_end"]["phases_s"]
    for phase in ("rollout", "old_log_prob", "values", "advantages", "update_critic", "update_actor", "logging"):
        assert math.isfinite(phases[phase]) and phases[phase] >= 0, phase
    assert details["end_to_end"]["time_to_target"]["steps_run"] == end_to_end.QUICK_STEPS
    assert set(details["accumulation"]["steps"]) == {"K=1", "K=8", "K=8 legacy"}
    batching = details["batching"]
    # both comparisons are of layouts that must sample the same tokens
    assert batching["continuous_batching"]["same_tokens"] and batching["shared_prefix"]["same_tokens"]
    # decoded row-steps are counted exactly: slots refilled as rows end never decode more than all rows at once
    cb = batching["continuous_batching"]
    assert cb["continuous"]["decode_slots"] < cb["all_rows"]["decode_slots"]
    assert 0 < cb["all_rows"]["useful_slot_fraction"] < cb["continuous"]["useful_slot_fraction"] <= 1
    sp = batching["shared_prefix"]
    one, each = sp["one_block"], sp["block_per_sample"]
    assert one["prompt_cache_bytes"] * sp["shape"]["n"] <= each["prompt_cache_bytes"] * 1.1


def test_quick_run_markdown_names_machine_versions_and_sections(quick_run):
    results, markdown = quick_run
    versions = results["environment"]["versions"]
    for text in (f"jax {versions['jax']}", f"torch {versions['torch']}", f"transformers {versions['transformers']}",
                 results["environment"]["cpu"], "## Headline ratios", "## Accumulation", "## Update step vs PyTorch",
                 "## Rollout", "## Rollout at a GSM8K-like shape", "## Sampler batching", "## End to end",
                 "## End to end vs TRL", "Not measured: TRL hidden", "## Accelerator"):
        assert text in markdown, text


@pytest.mark.parametrize(
    "family, tied", [("qwen2", False), ("qwen3", True)], ids=["qwen2-untied", "qwen3-tied-qk-norm"]
)
def test_torch_peer_computes_jppo_logits(family, tied):
    cfg = ModelConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
        model_type=family, tie_word_embeddings=tied, initializer_range=0.2,
    )
    model = create_model(CausalLM, cfg, seed=3)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (3, 11))
    expected = np.asarray(model(jnp.asarray(ids, jnp.int32)))
    peer = TorchCausalLM.from_jppo(cfg, jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param))))
    with torch.no_grad():
        got = peer(torch.as_tensor(ids)).numpy()
    # float32 through 2 layers: the implementations differ only in summation order (logits are O(1))
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_training_flops_count_by_hand():
    cfg = ModelConfig(vocab_size=10, hidden_size=4, intermediate_size=6, num_layers=2, num_heads=2, num_kv_heads=1)
    # head size 2: q 4x4, k and v 4x2 each, o 4x4, MLP 3 x 4x6 -> 16 + 16 + 16 + 72 = 120 per layer; head 10x4
    assert accelerator.matmul_parameters(cfg) == 2 * 120 + 40
    # 6 N + 12 L (H E) T at T = 8: 6 * 280 + 12 * 2 * 4 * 8
    assert accelerator.training_flops_per_token(cfg, 8) == 1680 + 768


@pytest.mark.parametrize(
    "kind, flops",
    [("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 80GB HBM3", 989e12), ("TPU v5 lite", 197e12), ("TPU v5", 459e12),
     ("cpu", None)],
)
def test_device_peaks_pick_the_most_specific_entry(kind, flops):
    assert accelerator.device_peaks(kind)[0] == flops


def test_side_by_side_warms_up_then_interleaves():
    calls = []
    timings = time_side_by_side({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeats=3)
    assert calls == ["a", "b"] + ["a", "b"] * 3
    assert all(t.repeats == 3 and t.min_s <= t.median_s <= t.max_s for t in timings.values())
    with pytest.raises(ValueError, match="repeats"):
        time_side_by_side({"a": lambda: None}, repeats=0)


def test_end_to_end_bookkeeping():
    records = [
        {"step": 1, "timing/step": 5.0, "timing/rollout": 3.0, "timing/update_actor": 2.0, "reward/mean": 0.2},
        {"step": 2, "timing/step": 1.0, "timing/rollout": 0.4, "timing/update_actor": 0.6, "reward/mean": 0.95},
        {"step": 3, "timing/step": 3.0, "timing/rollout": 0.6, "timing/update_actor": 2.4, "reward/mean": None},
    ]
    # (step, clock before log, clock after log) with the run started at clock 10
    marks = [(1, 16.0, 16.5), (2, 18.0, 18.1), (3, 21.5, 21.7)]
    result = end_to_end.summarize(records, marks, 10.0, 12.0, True, "cfg.yaml", [])
    assert result["first_step_s"] == 5.0
    assert result["seconds_per_step"] == 2.0  # median of steps 2 and 3
    assert result["phases_s"]["rollout"] == pytest.approx(0.5)
    assert result["phases_s"]["logging"] == pytest.approx(0.15)
    # other: step 2: 18.1 - 16.5 - 1.0 - 0.1 = 0.5; step 3: 21.7 - 18.1 - 3.0 - 0.2 = 0.4
    assert result["phases_s"]["other"] == pytest.approx(0.45)
    assert list(result["phases_s"]) == ["rollout", "update_actor", "logging", "other"]
    target = result["time_to_target"]
    assert target["reached"] and target["step"] == 2
    assert target["wall_s"] == pytest.approx(8.1) and target["train_step_s"] == pytest.approx(6.0)


def test_run_rejects_an_unknown_benchmark_naming_the_valid_ones():
    with pytest.raises(SystemExit, match="nope.*valid: accumulation, update_vs_torch"):
        bench_run.selected(bench_run.parse_args(["--only", "accumulation,nope"]))


def test_async_rl_benchmark_smoke():
    """``bench.async_rl --quick`` (in this process, one device) times k = 0 and k = 1 and gives both ratios and the
    k = 1 waits (their values are not checked: times)."""
    result = async_rl.measure(quick=True, engines=["jppo"])["engines"]["jppo"]
    for k in ("k0", "k1"):
        assert len(result[k]["steps"]) == async_rl.QUICK_STEPS
        assert all(math.isfinite(result[k][name]) and result[k][name] >= 0
                   for name in ("step_s", "rollout_s", "train_s"))
    assert {"train_wait_s", "rollout_wait_s"} <= set(result["k1"]) and "train_wait_s" not in result["k0"]
    assert result["async_k1_vs_k0"] > 0 and result["async_bound_speedup"] >= 1


@pytest.mark.parametrize("args, message", [
    (["--repeats", "0"], "--repeats=0 must be >= 1"),
    (["--peak-tflops", "nan"], "--peak-tflops=nan must be a finite number > 0"),
    (["--bandwidth-gbs", "-1"], "--bandwidth-gbs=-1.0 must be a finite number > 0"),
    (["--only", "end_to_end", "--e2e-set", "rollout.val_n=0"], "--e2e-set: rollout.val_n=0 is invalid"),
    (["--only", "end_to_end", "--e2e-set", "data.task_options=[1,2]"], "--e2e-set: override 'data.task_options"),
])
def test_run_refuses_odd_arguments_in_one_line_before_measuring(tmp_path, capsys, args, message):
    assert bench_run.main(["--out", str(tmp_path / "out"), *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench.run: error: ") and message in lines[0], lines


def test_run_refuses_an_output_directory_it_cannot_create(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert bench_run.main(["--only", "sampler", "--out", str(tmp_path / "file" / "out")]) == 2
    assert "--out" in capsys.readouterr().err


def test_end_to_end_refuses_a_bad_override_in_one_line(capsys):
    assert end_to_end.main(["--quick", "--set", "actor.clip_ratio_c=0.5"]) == 2
    assert capsys.readouterr().err.strip() == (
        "bench.end_to_end: error: --set: actor.clip_ratio_c=0.5 is invalid: it must be > 1 (the dual-clip bound)"
    )


def test_trl_settings_make_one_jppo_training_step():
    cfg = peers.load_config(peers.QUICKSTART_GRPO, [*peers.COMMON, *peers.SHAPES["gsm8k_shape"].overrides])
    got = peers.trl_arguments(cfg)
    # 8 prompts x 8 = 64 sequences per step, one mini-batch of all 64, micro-batches of 8, 1 epoch: on-policy,
    # so TRL skips its old-log-prob pass (steps_per_generation == gradient_accumulation_steps) and so does jppo
    assert got == {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 8, "steps_per_generation": 8,
                   "num_iterations": 1, "num_generations": 8, "max_completion_length": 128,
                   "optimizer_steps_per_generation": 1}
    assert old_log_prob_source(cfg) == "update"
    quickstart = peers.trl_arguments(peers.load_config(peers.QUICKSTART_GRPO, list(peers.COMMON)))
    # 16 x 8 = 128 sequences, mini-batches of 64, 2 epochs: 4 optimizer steps of 8 micro-batches
    assert (quickstart["steps_per_generation"], quickstart["gradient_accumulation_steps"],
            quickstart["num_iterations"], quickstart["optimizer_steps_per_generation"]) == (16, 8, 2, 4)


def test_peer_gets_jppo_initial_weights_and_prompt_ids(tmp_path):
    """The exported initial policy computes jppo's logits in transformers, and the exported tokenizer gives the
    prompt ids jppo samples from (the wide vocabulary of the GSM8K-like shape, at its smoke size)."""
    import transformers

    shape = peers.QUICK_SHAPES["gsm8k_shape"]
    cfg, overrides = peers.shape_config(shape, 2, tmp_path)
    assert f"model.path={tmp_path / 'model'}" in overrides
    tokenizer = peers.build.load_inputs(cfg).tokenizer
    assert tokenizer.vocab_size == shape.vocab_size
    prompts = [e.prompt for e in peers.build.task_of(cfg.data).examples("train", 3, 0)]
    ours = np.array([tokenizer.encode(p, add_special_tokens=True) for p in prompts])
    theirs = transformers.AutoTokenizer.from_pretrained(cfg.model.path)(prompts)["input_ids"]
    np.testing.assert_array_equal(ours, np.array(theirs))
    assert peers.logits_max_abs_diff(cfg.model.path, ours) <= peers.LOGITS_ATOL


def test_peer_step_bookkeeping():
    assert per_step_seconds([1.0, 3.0, 3.5, 6.0]) == [2.0, 0.5, 2.5]
    jppo = [{"records": [{"step": s, "timing/step": t, "timing/rollout": t / 2} for s, t in
                         enumerate([9.0, 5.0, 1.0, 3.0], start=1)]}]
    trl = [{"steps": [{"step": t, "generate": 1.0} for t in (7.0, 6.0, 2.0, 4.0)], "mean_response_length": 4.0,
            "omp_wait_policy": None}]
    alone = [{"steps": [{"step": t} for t in (8.0, 6.0, 3.0, 5.0)], "train_s": 22.0, "omp_wait_policy": None}]
    tunix = [{"steps": [{"step": t, "generate": 2.0, "update": t - 2.0} for t in (5.0, 4.0, 6.0, 8.0)],
              "mean_response_length": 5.0}]
    result = peers.summarize(jppo, trl, first=3, alone_runs=alone, tunix_runs=tunix)
    assert result["trl_alone_s_per_step"] == 4.0 and result["trl_alone_train_s"] == [22.0]
    assert result["omp_wait_policy"] == {"jppo": [None], "trl": [None], "tunix": [None], "trl_alone": [None]}
    assert result["jppo_s_per_step"] == 2.0 and result["trl_s_per_step"] == 3.0  # medians of steps 3 and 4
    assert result["trl_over_jppo"] == 1.5 and result["jppo_phases_s"]["rollout"] == 1.0
    assert result["tunix_s_per_step"] == 7.0 and result["tunix_over_jppo"] == 3.5
    assert result["jppo_first_step_s"] == [9.0] and result["trl_first_step_s"] == [7.0]
    assert result["rounds_s_per_step"] == [{"jppo": 2.0, "trl": 3.0, "tunix": 7.0, "trl_alone": 4.0}]
    assert result["steps_in_medians"] == {"jppo": 2, "trl": 2, "tunix": 2}
    # the report's phase table: the step, its phases (0 for one a side did not run), the rest, each peer's ratio
    table = report.peer_phases({"shapes": {"quickstart": result}})
    assert table[2] == "| quickstart | jppo | 2.000 | 1.000 | 0.000 | 0.000 | 1.000 | 2.000 |  |"
    assert table[3] == "| quickstart | trl | 3.000 | 1.000 | 0.000 | 0.000 | 2.000 | 3.000 (alone: 4.000) | 1.50 |"
    assert table[4] == "| quickstart | tunix | 7.000 | 2.000 | 0.000 | 5.000 | 0.000 | 7.000 | 3.50 |"
    # a peer not run has no row and no ratio
    without = peers.summarize(jppo, trl, first=3)
    assert without["tunix_s_per_step"] is None and without["tunix_over_jppo"] is None
    assert len(report.peer_phases({"shapes": {"quickstart": without}})) == 4


def test_peers_without_trl_or_tunix_reports_null_with_the_reasons(monkeypatch):
    monkeypatch.setenv(peers.HIDE_TRL_ENV, "1")
    monkeypatch.setenv(tunix_side.HIDE_TUNIX_ENV, "1")
    result = peers.measure(quick=True)
    for key in TRL_KEYS[1:] + TUNIX_KEYS:
        assert result[key] is None, key
    assert peers.HIDE_TRL_ENV in result["trl_missing"] and result["shapes"] == {}
    assert tunix_side.HIDE_TUNIX_ENV in result["tunix_missing"]


@pytest.mark.parametrize("omp", ["user", "passive"])
def test_trainer_processes_get_the_users_openmp_policy_or_passive(omp):
    """A child started with ``bench.child_environment`` keeps the policy it was given through its own import of
    ``bench`` (which otherwise sets PASSIVE): the user's (here whatever this shell had, maybe none) or PASSIVE."""
    probe = "import bench, os; print(os.environ.get('OMP_WAIT_POLICY'))"
    env = bench.child_environment(omp)
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    expected = "PASSIVE" if omp == "passive" else str(bench.user_environment().get("OMP_WAIT_POLICY"))
    assert done.returncode == 0 and done.stdout.strip() == expected, done.stderr
    # without the marker, importing bench sets its default for in-process comparisons
    plain = {key: value for key, value in env.items() if key not in ("OMP_WAIT_POLICY", bench.OMP_AS_USER_ENV)}
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=plain, capture_output=True, text=True,
                          timeout=60)
    assert done.stdout.strip() == "PASSIVE", done.stderr
    with pytest.raises(ValueError, match="omp='spin'"):
        bench.child_environment("spin")


@pytest.mark.parametrize("args, message", [
    (["--omp", "spin"], "--omp=spin: must be one of user, passive"),
    (["--shapes", "gsm9k"], "--shapes=gsm9k: must name some of quickstart, gsm8k_shape"),
    (["--steps", "1"], "--steps=1 must be >= 2"),
    (["--rounds", "0"], "--rounds=0 must be >= 1"),
])
def test_peers_refuses_odd_arguments_in_one_line_before_measuring(capsys, args, message):
    assert peers.main(args) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench.peers: error: ") and message in lines[0], lines


def test_trl_alone_refuses_odd_arguments_in_one_line(capsys):
    assert trl_alone.main([]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["bench.trl_alone: error: expected one argument, the JSON spec bench.peers writes"]
