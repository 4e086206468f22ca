"""A run does not depend on the hardware: two training steps of each quickstart config give the same metrics,
step after step, on any mesh and with any micro-batching (docs/contract.md#runs-do-not-depend-on-the-hardware).

Every variant trains the shipped config (more than one mini-batch per step, two epochs: which rows share an
optimizer step matters) and is compared with one device and the shipped micro-batch size. The 2-process version
of the same comparison is in ``test_distributed.py``.
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
from typing import Optional

import chex
import jax
import numpy as np
import pytest
from signals import SIGNAL_POINTS, signal_at

from jppo.config import ConfigError, check_mesh, load_config
from jppo.parallel.mesh import make_mesh
from jppo.run import build
from jppo.run.collect import collect
from jppo.run.learn import learn
from jppo.run.loop import run, setup
from jppo.runlog.timing import PhaseTimer

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = {"ppo": ROOT / "configs" / "quickstart.yaml", "grpo": ROOT / "configs" / "quickstart_grpo.yaml"}
RUNS = {**CONFIGS, "moe": ROOT / "configs" / "quickstart_moe.yaml"}  # what train() runs; the variants take CONFIGS
QUIET = ["trainer.total_steps=2", "trainer.val_every=0", "trainer.plots=false", "trainer.logger=[console,jsonl]",
         "trainer.progress_bar=false", "trainer.save_every=0"]
ROLES = ("actor", "critic")
BUDGET_16 = [f"{role}.{key}" for role in ROLES for key in ("use_dynamic_bsz=true", "ppo_max_token_len=16")]

# name -> (devices, overrides). No fixed-cut variant on the 2x2x1 mesh: a fixed cut sees the mesh only through its
# number of batch shards, and that mesh's sampling, row placement and fsdp-sharded update run in dynamic-mesh2x2x1
# (fsdp with a fixed cut runs in mesh1x2x2). Pure data parallelism with a fixed cut: the default run on 8 devices of
# test_bitwise_runs_log_and_save_the_same_bits_on_any_mesh_and_cut.
VARIANTS = {
    "mesh1x2x2": (4, ["mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2"]),
    "micro1": (1, [f"{role}.ppo_micro_batch_size=1" for role in ROLES]),
    "dynamic-mesh2x2x1": (4, ["mesh.data=2", "mesh.fsdp=2", *BUDGET_16]),
    # context parallel: each 16-token packed row's tokens over two devices (the shipped fixed rows, 8 + 5 tokens,
    # do not split in two)
    "sequence2-mesh2x1x1x2": (4, ["mesh.data=2", "mesh.sequence=2", *BUDGET_16]),
}


def train(config: str, out: pathlib.Path, devices: int, overrides: list[str]) -> list[dict]:
    cfg = load_config(RUNS[config], [*QUIET, f"trainer.output_dir={out}", "mesh.data=1", *overrides])
    run(cfg, check_mesh(cfg, devices), build.load_inputs(cfg), devices=jax.devices()[:devices])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith(("timing/", "perf/"))} for row in rows]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One device, the shipped micro-batching; computed once per config."""
    cache = {}

    def get(config: str) -> list[dict]:
        if config not in cache:
            cache[config] = train(config, tmp_path_factory.mktemp(f"reference-{config}"), 1, [])
        return cache[config]

    return get


def assert_same_run(actual: list[dict], expected: list[dict]) -> None:
    assert [row["step"] for row in actual] == [row["step"] for row in expected] == [1, 2]
    for step, (a, b) in enumerate(zip(actual, expected), start=1):
        assert set(a) == set(b), set(a) ^ set(b)
        for name, value in b.items():
            # float32, two steps of four Adam updates each: the same sums in another order agree to ~1e-5
            np.testing.assert_allclose(a[name], value, rtol=1e-4, atol=1e-6, err_msg=f"step {step}: {name}")


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("config", list(CONFIGS))
def test_two_steps_do_not_depend_on_the_mesh_or_the_micro_batching(tmp_path, reference, config, variant):
    devices, overrides = VARIANTS[variant]
    if config == "grpo":
        overrides = [o for o in overrides if not o.startswith("critic.")]
    expected = reference(config)
    # every config has several optimizer steps per training step, so a mesh-dependent mini-batch split would show
    cfg = load_config(CONFIGS[config], [])
    assert cfg.data.train_batch_size // cfg.actor.ppo_mini_batch_size * cfg.actor.ppo_epochs > 1
    assert_same_run(train(config, tmp_path, devices, overrides), expected)


def test_two_moe_steps_with_the_experts_split_over_four_devices_log_the_one_device_run(tmp_path, reference):
    """quickstart_moe (8 experts, top 2, the load-balancing loss on): two steps on data 2 x expert 2, each device
    holding 4 experts and the tokens of a group gathered to them, log what one device logs, the router metrics
    (``actor/router_aux_loss``, ``actor/expert_load``) included."""
    expected = reference("moe")
    assert {"actor/router_aux_loss", "actor/expert_load"} <= set(expected[0])
    assert_same_run(train("moe", tmp_path, 4, ["mesh.data=2", "mesh.expert=2"]), expected)


BITWISE = ["trainer.deterministic=bitwise", "trainer.save_every=2", "trainer.async_checkpoint=false"]


def saved_arrays(out: pathlib.Path) -> list[np.ndarray]:
    """Every array of the run's last checkpoint (the state of both roles: weights, Adam's moments, counters)."""
    import orbax.checkpoint as ocp

    state = ocp.PyTreeCheckpointer().restore(out / "checkpoints" / "2" / "state")
    return [np.asarray(x) for x in jax.tree.leaves(state)]


def test_bitwise_runs_log_and_save_the_same_bits_on_any_mesh_and_cut(tmp_path, reference):
    """trainer.deterministic=bitwise (the PPO quickstart, two steps of four optimizer steps per role): one device (8
    micro-batches of 8 sequences per optimizer step), 8 devices (one micro-batch each), and 4 (data 2 x fsdp 2) with
    token budgets log the same metrics and save the same checkpoint, bit for bit, and the sampler's log-probs are
    the trainer's; the default run on 8 devices does not log the one-device run's bits (the comparison
    can fail) but agrees with it to float32 rounding."""
    runs = {name: (devices, [*BITWISE, *overrides]) for name, (devices, overrides) in {
        "one": (1, []), "eight": (8, ["mesh.data=8"]),
        "fsdp-dynamic": (4, ["mesh.data=2", "mesh.fsdp=2", *BUDGET_16]),
    }.items()}
    logged = {name: train("ppo", tmp_path / name, *spec) for name, spec in runs.items()}
    saved = {name: saved_arrays(tmp_path / name) for name in runs}
    for row in logged["one"]:  # the sampler's log-probs are the trainer's, bit for bit
        assert row["rollout/log_prob_abs_diff"] == row["rollout_corr/kl"] == 0.0
    for name in ("eight", "fsdp-dynamic"):
        assert logged[name] == logged["one"], name
        assert len(saved[name]) == len(saved["one"]) > 100
        assert all(np.array_equal(a, b) for a, b in zip(saved[name], saved["one"])), name
    default = train("ppo", tmp_path / "default", 8, ["mesh.data=8"])
    assert default != reference("ppo")
    assert_same_run(default, reference("ppo"))
    assert_same_run(logged["one"], reference("ppo"))  # the same training, to float32 rounding


def test_bitwise_moe_runs_log_and_save_the_same_bits_on_one_and_four_devices(tmp_path):
    """quickstart_moe (8 experts, top 2, the load-balancing loss on) in trainer.deterministic=bitwise: one device and
    four log the same metrics, router metrics included, and save the same checkpoint; the sampler's log-probs are
    the trainer's, bit for bit, with no routing replay (the sampler routes every token as the trainer does)."""
    logged = {devices: train("moe", tmp_path / str(devices), devices, [*BITWISE, f"mesh.data={devices}"])
              for devices in (1, 4)}
    assert logged[4] == logged[1]
    assert {"actor/router_aux_loss", "actor/expert_load"} <= set(logged[1][0])
    for row in logged[1]:
        assert row["rollout/log_prob_abs_diff"] == row["rollout_corr/kl"] == 0.0
    one, four = saved_arrays(tmp_path / "1"), saved_arrays(tmp_path / "4")
    assert len(one) == len(four) > 20 and all(np.array_equal(a, b) for a, b in zip(one, four))


def counted(traces: collections.Counter, name: str, fn):
    def wrapper(*args, **kwargs):
        traces[name] += 1  # runs only while jit traces
        return fn(*args, **kwargs)

    return wrapper


def test_a_short_run_compiles_the_update_steps_and_the_sampler_once(tmp_path, monkeypatch):
    """Three training steps trace each compiled program once: a recompilation per step would fail here."""
    import jppo.rollout.decode as sampler_module

    chex.clear_trace_counter()
    traces = collections.Counter()
    monkeypatch.setattr(sampler_module, "rollout",
                        counted(traces, "rollout", chex.assert_max_traces(sampler_module.rollout, n=1)))
    # a temperature no other test uses: the sampler's jitted function is cached per sampling parameters
    cfg = load_config(CONFIGS["ppo"], [*QUIET, "trainer.total_steps=3", f"trainer.output_dir={tmp_path}",
                                       "mesh.data=2", "data.train_batch_size=16", "actor.ppo_mini_batch_size=8",
                                       "critic.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size=2",
                                       "critic.ppo_micro_batch_size=2", "rollout.temperature=0.9"])
    mesh = make_mesh(*check_mesh(cfg, 2), devices=jax.devices()[:2])
    state, collector, learner, _ = setup(cfg, mesh, build.load_inputs(cfg))
    for name, update in (("actor", learner.actor_step), ("critic", learner.critic_step)):
        # chex tells functions apart by their source and call stack, which the two roles' steps share: 2 in all
        update._steps = counted(traces, name, chex.assert_max_traces(update._steps, n=2))
    for _ in range(3):
        state, experience, _ = collect(collector, state, PhaseTimer())
        state, metrics = learn(learner, state, experience, PhaseTimer())
    assert int(state.step) == 3 and np.isfinite(metrics["actor/pg_loss"])
    assert traces == {"rollout": 1, "actor": 1, "critic": 1}


# trainer.off_policy_steps=1 (GRPO, 3 steps): step 2 trains on a batch one update old, and validates
OFF_POLICY = ["trainer.off_policy_steps=1", "trainer.total_steps=3", "trainer.val_every=2", "data.num_val_examples=16"]


def without_waits(rows: list[dict]) -> list[dict]:
    """Rows without the async wait seconds (measured times, like timing/*)."""
    return [{k: v for k, v in row.items() if not k.endswith("_wait_s")} for row in rows]


@pytest.fixture(scope="module")
def off_policy_run(tmp_path_factory):
    """One device: the next rollout generated on a thread beside the update."""
    return train("grpo", tmp_path_factory.mktemp("off-policy"), 1, OFF_POLICY)


def test_an_off_policy_run_does_not_depend_on_the_mesh_or_the_thread(tmp_path, off_policy_run):
    """Four devices generate in turn, one device beside the update: the same numbers (float32, as above)."""
    assert [row["async/staleness"] for row in off_policy_run] == [0.0, 1.0, 1.0]
    assert all(row["async/train_wait_s"] >= 0 and row["async/rollout_wait_s"] >= 0 for row in off_policy_run)
    assert "val/reward/mean" in off_policy_run[1] and "val/reward/mean" not in off_policy_run[2]
    actual, expected = (without_waits(train("grpo", tmp_path, 4, ["mesh.data=4", *OFF_POLICY])),
                        without_waits(off_policy_run))
    assert [row["step"] for row in actual] == [1, 2, 3]
    for step, (a, b) in enumerate(zip(actual, expected), start=1):
        assert set(a) == set(b), set(a) ^ set(b)
        for name, value in b.items():
            np.testing.assert_allclose(a[name], value, rtol=1e-4, atol=1e-6, err_msg=f"step {step}: {name}")


# A run killed by SIGKILL in step 2's update, step 3's rollout in flight on its thread (jppo.run.offpolicy): the
# config and overrides come as arguments; the process's one CPU device is the 1-device mesh of off_policy_run.
KILLED_IN_STEP_2 = textwrap.dedent(
    """
    import os, signal, sys
    import jppo.run.loop as loop
    from jppo.config import check_mesh, load_config
    from jppo.run import build

    learn = loop.learn

    def killed_in_step_2(learner, state, experience, timer):
        if int(state.step) + 1 == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return learn(learner, state, experience, timer)

    loop.learn = killed_in_step_2
    cfg = load_config(sys.argv[1], sys.argv[2:])
    loop.run(cfg, check_mesh(cfg, 1), build.load_inputs(cfg))
    """
)


def test_an_off_policy_run_killed_mid_update_resumes_bitwise(tmp_path, off_policy_run):
    """SIGKILL in step 2's update, with step 3's rollout in flight; the checkpoint of step 1 holds the weights that
    sample step 2's batch, so the resumed run regenerates it and logs what the uninterrupted run logged: no step
    lost, none twice."""
    from jppo.run import lifecycle

    saving = ["trainer.save_every=1", "trainer.async_checkpoint=false"]
    overrides = [*QUIET, f"trainer.output_dir={tmp_path}", "mesh.data=1", *OFF_POLICY, *saving]
    # the suite's optimization level (inherited) and compilation cache, so the programs are the in-process ones
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT),
               JAX_COMPILATION_CACHE_DIR=str(jax.config.jax_compilation_cache_dir))
    env.pop("XLA_FLAGS", None)
    killed = subprocess.run([sys.executable, "-c", KILLED_IN_STEP_2, str(CONFIGS["grpo"]), *overrides], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert [row["step"] for row in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())] == [1]
    resumed = train("grpo", tmp_path, 1, [*OFF_POLICY, *saving])
    assert without_waits(resumed) == without_waits(off_policy_run)
    other_k = load_config(CONFIGS["grpo"], [*QUIET, f"trainer.output_dir={tmp_path}", "trainer.off_policy_steps=2"])
    with pytest.raises(ConfigError, match=r"^trainer.off_policy_steps=2: checkpoint .* was written with "
                                          r"trainer.off_policy_steps=1 \(resume with that, or trainer.resume=never\)$"):
        lifecycle.read_resume(other_k, tmp_path / "checkpoints")  # its queue holds 1 batch's weights, k=2 needs 2


def test_an_off_policy_run_stopped_by_signals_resumes_bitwise(tmp_path, off_policy_run, monkeypatch):
    """SIGTERM or SLURM's SIGUSR1 at a seeded random point (tests/signals.py) of step 1, then of step 2 of the resumed
    run: each time the run saves the step it is in and stops (jppo.parallel.preemption.Preempted; step 1 is not a
    periodic save); the last resume logs what the uninterrupted run logged, bit for bit (but the validation of the
    stopped step 2), no step lost, none twice."""
    import random
    import threading

    from jppo.parallel.preemption import Preempted
    from jppo.run.checkpoint import committed_steps

    assert threading.current_thread() is threading.main_thread()  # where the run's signal handlers go
    handler, draw = signal.getsignal(signal.SIGTERM), random.Random(20261203)
    saving = ["trainer.save_every=2", "trainer.async_checkpoint=true"]
    first = draw.choice(SIGNAL_POINTS[:-1])  # two points apart
    for step, point in ((1, first), (2, draw.choice([p for p in SIGNAL_POINTS if p != first]))):
        number = draw.choice([signal.SIGTERM, signal.SIGUSR1])
        with monkeypatch.context() as patch:
            signal_at(patch, step, point, number)
            with pytest.raises(Preempted, match=f"after step {step}, checkpointed") as stopped:
                train("grpo", tmp_path, 1, [*OFF_POLICY, *saving])
        assert stopped.value.signal_name == signal.Signals(number).name, point
        assert committed_steps(tmp_path / "checkpoints") == list(range(1, step + 1)), point
        logged = [row["step"] for row in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())]
        assert logged == list(range(1, step + 1)), point
        assert signal.getsignal(signal.SIGTERM) == handler  # the run's handlers are gone with it
    resumed = train("grpo", tmp_path, 1, [*OFF_POLICY, *saving])
    expected = without_waits(off_policy_run)
    # step 2 validates (trainer.val_every=2) and was stopped: it saved without validating (a whole validation could
    # outlast the grace period), and logged the rest
    assert "val/reward/mean" in expected[1]
    expected[1] = {k: v for k, v in expected[1].items() if not k.startswith("val/")}
    assert without_waits(resumed) == expected


def logged_moves(out: pathlib.Path) -> list[tuple[Optional[float], float, float]]:
    """Each step's seconds of weight moves (None: no rollout generated during the step), and the bytes of the
    weights that sampled its batch and of the batch, as the run logged them."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(row.get("timing/weight_move"), row["perf/weight_move_bytes"], row["perf/batch_move_bytes"])
            for row in rows]


def test_a_rollout_on_a_device_of_its_own_logs_the_colocated_run(tmp_path, reference):
    """rollout.devices=1 on two devices (1 + 1), on-policy: the sampler on the second device, the weights moved to it
    before every rollout, logs what one device logs (float32, as above)."""
    assert_same_run(train("grpo", tmp_path, 2, ["rollout.devices=1"]), reference("grpo"))
    moves = logged_moves(tmp_path)
    assert all(seconds > 0 and size > 0 and batch > 0 for seconds, size, batch in moves)
    assert len({size for _, size, _ in moves}) == 1  # the same weights every step
    from jppo.preflight.split_memory import split_plans  # the plan's replica is what moved (float32 here)

    cfg = load_config(CONFIGS["grpo"], ["rollout.devices=1"])
    assert moves[0][1] == split_plans(cfg, check_mesh(cfg, 2))[1].term("rollout_weights")


@pytest.mark.parametrize("devices,overrides", [(2, ["rollout.devices=1"]), (4, ["mesh.data=2", "rollout.devices=2"])])
def test_an_off_policy_rollout_on_devices_of_its_own_logs_the_colocated_run(tmp_path, off_policy_run, devices,
                                                                            overrides):
    """k = 1 with the rollout on devices of its own (1 + 1, and 2 + 2: rows decoded over two devices, the update
    over two others), the next rollout generated beside the update: the one-device run's numbers."""
    actual = without_waits(train("grpo", tmp_path, devices, [*overrides, *OFF_POLICY]))
    expected = without_waits(off_policy_run)
    assert [row["step"] for row in actual] == [1, 2, 3]
    for step, (a, b) in enumerate(zip(actual, expected), start=1):
        assert set(a) == set(b), set(a) ^ set(b)
        for name, value in b.items():
            np.testing.assert_allclose(a[name], value, rtol=1e-4, atol=1e-6, err_msg=f"step {step}: {name}")
    moves = logged_moves(tmp_path)  # step 1 generates batches 1 and 2, step 2 batch 3, step 3 nothing
    assert [seconds is not None for seconds, _, _ in moves] == [True, True, False]
    assert all(size > 0 and batch > 0 for _, size, batch in moves)


# A run with the rollout on a device of its own (1 + 1) killed by SIGKILL with step 3's weight move under way (on the
# rollout thread, during step 2's update: the run's third move, after batches 1 and 2 of step 1)
KILLED_IN_THE_MOVE = textwrap.dedent(
    """
    import os, signal, sys
    import jax
    jax.config.update("jax_num_cpu_devices", 2)
    from jax.sharding import NamedSharding, PartitionSpec
    from jppo.config import check_mesh, load_config
    from jppo.run import build, loop, rollout_mesh

    move, calls = rollout_mesh.WeightMove.__call__, []

    def killed_in_the_third_move(self, weights):
        calls.append(self)
        if len(calls) == 3:
            jax.device_put(weights, NamedSharding(self.mesh, PartitionSpec()))  # the copy dispatched, not done
            os.kill(os.getpid(), signal.SIGKILL)
        return move(self, weights)

    rollout_mesh.WeightMove.__call__ = killed_in_the_third_move
    cfg = load_config(sys.argv[1], sys.argv[2:])
    loop.run(cfg, check_mesh(cfg, 2), build.load_inputs(cfg))
    """
)


def test_a_run_killed_during_the_weight_move_resumes_bitwise(tmp_path, off_policy_run):
    """SIGKILL while the weights move to the rollout's own device for step 3's batch: the resumed run (step 1's
    checkpoint; batch 2 regenerated on the rollout device from the saved queue) logs what the uninterrupted
    one-device run logged, bit for bit."""
    saving = ["trainer.save_every=1", "trainer.async_checkpoint=false"]
    overrides = [*QUIET, f"trainer.output_dir={tmp_path}", "mesh.data=1", "rollout.devices=1", *OFF_POLICY, *saving]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT),
               JAX_COMPILATION_CACHE_DIR=str(jax.config.jax_compilation_cache_dir))
    env.pop("XLA_FLAGS", None)
    killed = subprocess.run([sys.executable, "-c", KILLED_IN_THE_MOVE, str(CONFIGS["grpo"]), *overrides], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert [row["step"] for row in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())] == [1]
    resumed = train("grpo", tmp_path, 2, ["rollout.devices=1", *OFF_POLICY, *saving])
    assert without_waits(resumed) == without_waits(off_policy_run)
