"""rollout.engine: vllm on a server of its own (rollout.vllm.num_servers), against the real vLLM CPU build in a
process the run starts: the weights streamed over gloo give the trainer's log-probs, a GRPO run with the rollout
beside the update learns, a killed server is restarted and its rows sampled again, and the failures that must not
hang (a server that never joins the weight group) end in one line within the timeout.

One server serves the module (its start takes ~40 s here): runs with the same policy shape reuse it
(:func:`jppo.rollout.vllm_engine.start`). The kill test comes last: it restarts that server.
"""

import http.server
import json
import os
import pathlib
import re
import signal
import threading
import time

import jax
import numpy as np
import pytest
from vllm_cases import GRPO, VLLM, Setup, moved, require_vllm, started, trainer_log_probs

from jppo.config import ConfigError, check_mesh, load_config
from jppo.config.views import rollout_engine_spec, sampling_params
from jppo.models.hf import hf_tensors
from jppo.parallel.hostlocal import gather_to_host
from jppo.rollout import vllm_engine, vllm_server, vllm_worker, weight_stream
from jppo.rollout.vllm_remote import VLLMServers
from jppo.run import build

require_vllm()
SERVER = VLLM + ["rollout.vllm.num_servers=1"]  # the same policy and engine on one server of its own


@pytest.fixture(scope="module")
def setup():
    return started(SERVER)


def sampler(s: Setup):
    params = sampling_params(s.cfg, s.tokenizer)
    return s.engine.sampler(s.models.actor.graphdef, s.tokenizer.pad_id, s.mesh, params, s.cfg.rollout.prompt_bucket)


def test_weights_streamed_to_a_server_give_the_trainers_log_probs(setup):
    """Each push streams every Hugging Face tensor of the policy once (its bytes counted exactly: float32 here)
    as the next policy version, and the server's sampled log-probs are the trainer's recomputation after it."""
    s, vllm = setup, sampler(setup)
    assert s.engine.addresses and all(p.process.poll() is None for p in s.engine.local)
    expected = sum(array.nbytes for _, array in hf_tensors(s.models.policy, gather_to_host))
    for weights in (s.models.actor.params, moved(s.models.actor.params, 2)):
        version = s.engine.version
        exp = vllm(weights, s.prompts, jax.random.key(1))
        assert s.engine.version == version + 1 and s.engine.push_bytes == expected
        mask = exp.response_mask.astype(bool)
        assert mask.any(axis=1).all()
        gap = np.abs(exp.rollout_log_prob - trainer_log_probs(s, weights, exp))[mask]
        print("server log-prob gap vs trainer: max", gap.max(), "push bytes", s.engine.push_bytes)
        assert gap.max() < 1e-5  # float32 rounding of one model in two libraries (measured: 6e-7)
    assert not s.engine.push(weights)  # the arrays it holds: nothing streamed


def test_a_grpo_run_on_a_server_learns_with_the_next_rollout_beside_the_update(setup, tmp_path):
    """``trainer.off_policy_steps=1``: the server generates step t + 1's batch while step t's update trains; the run
    learns, each step's batch is one update old, and every step after the first streamed its weights."""
    from jppo.run.loop import run

    cfg = load_config(GRPO, SERVER + [
        "trainer.off_policy_steps=1", "trainer.total_steps=12", "trainer.val_every=0",
        f"trainer.output_dir={tmp_path}", "trainer.logger=[jsonl]", "trainer.plots=false",
        "trainer.progress_bar=false"])
    run(cfg, check_mesh(cfg, len(jax.devices())), build.load_inputs(cfg))
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rewards = np.array([m["reward/mean"] for m in steps])
    print("rewards", np.round(rewards, 3), "push s", [round(m.get("timing/weight_push", 0), 3) for m in steps][:6])
    assert len(steps) == 12
    assert rewards[-5:].mean() > rewards[:5].mean() + 0.02  # measured: 0.076 -> 0.114
    assert [m["async/staleness"] for m in steps] == [0.0] + [1.0] * 11
    assert all(m["rollout/weight_push_bytes"] > 0 and m["rollout/server_restarts"] == 0 for m in steps)
    versions = [m["rollout/policy_version"] for m in steps]  # one push per batch: the versions count up by one
    assert versions == list(range(int(versions[0]), int(versions[0]) + 12))


def test_an_async_run_killed_with_a_rollout_in_flight_resumes_as_if_never_stopped(setup, tmp_path, monkeypatch):
    """k = 1, a checkpoint every step; the run dies in step 3's update while the server generates step 4's batch
    (the process's state is lost, as under SIGKILL: what survives is the checkpoint of step 2). The same command
    resumes: it regenerates step 3's batch from the checkpointed weight queue and logs what the uninterrupted run
    logs, step for step (the same rows, seeds and weights on the same server: bit for bit)."""
    import jppo.run.loop as loop

    def four_steps(out: pathlib.Path) -> None:
        cfg = load_config(GRPO, SERVER + [
            "trainer.off_policy_steps=1", "trainer.total_steps=4", "trainer.save_every=1", "trainer.val_every=0",
            f"trainer.output_dir={out}", "trainer.logger=[jsonl]", "trainer.plots=false",
            "trainer.progress_bar=false"])
        loop.run(cfg, check_mesh(cfg, len(jax.devices())), build.load_inputs(cfg))

    def logged(out: pathlib.Path) -> list[dict]:
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        # what the run does not decide: timings, and the server's count of pushes (it served the other runs too)
        timing = ("timing/", "perf/", "async/train_wait_s", "async/rollout_wait_s", "rollout/policy_version")
        return [{k: v for k, v in row.items() if not k.startswith(timing)} for row in rows]

    four_steps(tmp_path / "straight")
    learn, in_flight = loop.learn, []

    def dies_in_step_3(learner, state, experience, timer):
        if int(state.step) == 2:
            in_flight.append(True)
            raise KeyboardInterrupt("killed")
        return learn(learner, state, experience, timer)

    monkeypatch.setattr(loop, "learn", dies_in_step_3)
    with pytest.raises(KeyboardInterrupt):
        four_steps(tmp_path / "killed")
    assert in_flight and [row["step"] for row in logged(tmp_path / "killed")] == [1, 2]
    monkeypatch.setattr(loop, "learn", learn)
    four_steps(tmp_path / "killed")
    assert logged(tmp_path / "killed") == logged(tmp_path / "straight")


class StalledServer(http.server.BaseHTTPRequestHandler):
    """A server that answers ``/info`` like a rollout server and then stalls: on ``/join`` (``joins`` False) or,
    having joined the weight group, on taking the weights (``/start``)."""

    joins = False

    def do_GET(self):  # noqa: N802
        self.answer({"vllm": "0.32.0", "key": None, "version": -1, "pid": 0})

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/join" and self.joins:
            self.server.group = weight_stream.open_group(body["host"], body["port"], body["rank"], body["world"],
                                                         body["backend"], body["timeout_s"], body["name"])
            self.answer({})
            return
        time.sleep(3600)

    def answer(self, body: dict):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("joins", [False, True], ids=["never-joins", "joins-then-stalls"])
def test_a_server_that_stalls_is_one_line_within_the_timeout_never_a_hang(setup, joins):
    """A server that never joins the weight group, or joins and never takes the weights: the run's start-up ends
    in one line naming the server (and, for the push, the bytes sent) after rollout.vllm.timeout_s (3 s here)."""
    handler = type("Handler", (StalledServer,), {"joins": joins})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    address = f"127.0.0.1:{httpd.server_address[1]}"
    cfg = load_config(GRPO, VLLM + [f"rollout.vllm.servers=[{address}]", "rollout.vllm.timeout_s=3",
                                           "rollout.vllm.bucket_bytes=1048576"])
    started = time.monotonic()
    with pytest.raises(ConfigError) as error:  # not through vllm_engine.start, which would stop the module's server
        VLLMServers(rollout_engine_spec(cfg, setup.models.policy), vllm_engine.VLLMSampler)
    httpd.shutdown()
    assert time.monotonic() - started < 20  # the 3 s timeout (twice at most), not a hang
    message = str(error.value)
    print(message)
    assert "\n" not in message and address in message
    assert message.startswith("rollout.engine='vllm' could not start its servers: ")
    if joins:
        assert re.search(r"the weight push to .* did not finish within 3 s \(rollout.vllm.timeout_s\): after \d+ "
                         r"bytes", message)
    else:
        assert "did not join" in message


def test_rollout_devices_with_vllm_are_servers_of_their_own_and_the_trainer_keeps_its_devices():
    """``rollout.devices=1`` with vLLM is one server this run starts; the training mesh keeps all 8 devices (a
    server is a process, not a JAX device); with ``rollout.vllm.num_servers`` too it is one line."""
    cfg = load_config(GRPO, VLLM + ["rollout.devices=1"])
    assert (cfg.rollout.devices, cfg.rollout.vllm.num_servers) == (0, 1)
    assert check_mesh(cfg, 8) == check_mesh(load_config(GRPO, VLLM), 8)


def test_on_a_gpu_node_jax_in_the_run_keeps_the_gpus_the_servers_do_not_take(monkeypatch):
    """What the commands set before JAX starts its backend (:func:`jppo.cli.keep_trainer_gpus`): with four GPUs
    visible and two servers, JAX gets the first two; on a host without GPUs nothing is set."""
    from jppo import cli

    cfg = load_config(GRPO, VLLM + ["rollout.devices=2"])
    before = jax.config.read("jax_cuda_visible_devices")
    try:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
        cli.keep_trainer_gpus(cfg)
        assert jax.config.read("jax_cuda_visible_devices") == "0,1"  # ordinals of CUDA_VISIBLE_DEVICES
        jax.config.update("jax_cuda_visible_devices", before)
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
        cli.keep_trainer_gpus(cfg)
        assert jax.config.read("jax_cuda_visible_devices") == before
    finally:
        jax.config.update("jax_cuda_visible_devices", before)


@pytest.mark.parametrize("num_servers,gpus,visible,servers,kept", [
    (2, [], ["0", "1", "2", "3", "4", "5", "6", "7"], [["6"], ["7"]], [0, 1, 2, 3, 4, 5]),  # the last N, one each
    (1, [1], ["4", "5", "6", "7"], [["5"]], [0, 2, 3]),  # ordinals of CUDA_VISIBLE_DEVICES, named as it names them
    (2, [3, 1], ["GPU-a", "GPU-b", "GPU-c", "GPU-d"], [["GPU-d"], ["GPU-b"]], [0, 2]),  # in the order given
    (2, [], [], [[], []], []),  # a CPU host: server processes, and the trainer keeps its devices
])
def test_the_servers_gpus_are_never_the_trainers(num_servers, gpus, visible, servers, kept):
    assert vllm_server.split_gpus(num_servers, gpus, visible) == (servers, kept)


@pytest.mark.parametrize("num_servers,gpus,message", [
    (2, [], r"^rollout.vllm.num_servers=2 \(rollout.devices\) with gpus \[0, 1\] leaves the trainer none of this "
            r"host's 2 GPUs"),
    (3, [], r"^rollout.vllm.num_servers=3 \(rollout.devices\) with gpus \[0, 1\] leaves the trainer none"),
    (1, [2], r"^rollout.vllm.gpus=\[2\]: distinct GPUs among this process's 2 \(CUDA_VISIBLE_DEVICES: 0,1\)$"),
    (2, [1, 1], r"^rollout.vllm.gpus=\[1, 1\]: distinct GPUs"),
])
def test_gpus_the_host_does_not_have_are_one_line(num_servers, gpus, message):
    with pytest.raises(ConfigError, match=message):
        vllm_server.split_gpus(num_servers, gpus, ["0", "1"])


def test_a_vllm_outside_the_supported_range_is_one_line_naming_it():
    assert vllm_worker.check_version("0.32.0") == "0.32.0"
    low, high = vllm_worker.SUPPORTED
    for version in ("0.10.2", high + ".0", "1.0.0"):
        with pytest.raises(RuntimeError, match=rf"^vLLM {version} is installed; jppo supports vLLM >= {low}, "
                                               rf"< {high} "):
            vllm_worker.check_version(version)


def test_a_killed_server_is_restarted_and_its_rows_sampled_again(setup):
    """SIGKILL the server: the next generation finds it gone, starts another, streams it the current weights and
    asks it for the same rows with the same seeds, which come back as before the kill (the module's last test)."""
    s, vllm = setup, sampler(setup)
    weights = moved(s.models.actor.params, 5)
    before = vllm(weights, s.prompts, jax.random.key(7))
    old = s.engine.local[0].process
    os.kill(old.pid, signal.SIGKILL)
    old.wait()
    after = vllm(weights, s.prompts, jax.random.key(7))
    assert s.engine.restarts == 1 and s.engine.local[0].process.pid != old.pid
    np.testing.assert_array_equal(after.response_ids, before.response_ids)
    np.testing.assert_array_equal(after.response_mask, before.response_mask)
    np.testing.assert_allclose(after.rollout_log_prob, before.rollout_log_prob, atol=1e-6)
    s.engine.close()
    assert s.engine.local[0].process.poll() is not None
