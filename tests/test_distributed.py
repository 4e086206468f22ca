"""Multi-process runs (2 CPU processes of 2 devices on localhost) give the same steps as one process of 1 device,
their checkpoints resume in one process, the TPU scripts print the right gcloud commands, and bad start-up
arguments fail fast with one line."""

from __future__ import annotations

import argparse
import http.server
import json
import os
import pathlib
import random
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import threading

import pytest

from jppo.parallel import distributed

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "quickstart.yaml")
SMALL = [
    "data.train_batch_size=16", "actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=8",
    "actor.ppo_micro_batch_size=1", "critic.ppo_micro_batch_size=1", "trainer.plots=false",
    "trainer.logger=[console,jsonl]", "trainer.progress_bar=false", "trainer.val_every=2", "data.num_val_examples=16",
    "data.val_batch_size=16",
]


def env(devices: int, optimized: bool = True) -> dict:
    """A process of ``devices`` CPU devices, its programs optimized as a user's run compiles them (the rest of the
    suite compiles at XLA's lowest optimization level, tests/conftest.py); not ``optimized``: at the suite's level."""
    out = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    if optimized:
        out.pop("JAX_DISABLE_MOST_OPTIMIZATIONS", None)
    out["PYTHONPATH"] = str(ROOT) + os.pathsep + out.get("PYTHONPATH", "")
    return out


def train(*args: str, devices: int, config: str = CONFIG, optimized: bool = True) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "jppo.train", "--config", config, *SMALL, *args], cwd=ROOT,
                            env=env(devices, optimized), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(process: subprocess.Popen, timeout: float = 600) -> str:
    out, _ = process.communicate(timeout=timeout)
    assert process.returncode == 0, out[-3000:]
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def metrics(run_dir: pathlib.Path, every_key: bool = False) -> list[dict]:
    """The run's logged rows, without the keys that vary from run to run unless ``every_key``."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if every_key:
        return rows
    # times (the off-policy waits too) differ from run to run; everything else is a function of the config
    timing = ("timing/", "perf/", "async/train_wait_s", "async/rollout_wait_s")
    return [{k: v for k, v in row.items() if not k.startswith(timing)} for row in rows]


@pytest.mark.parametrize("config, extra, layouts", [
    # PPO on-policy (k = 0), two 2-process runs beside one 1-device run: the 2 x 2 devices of one mesh (4 batch
    # shards, rows moving between hosts to form each mini-batch), resumed on 1 device; and the rollout on devices of
    # its own (rollout.devices: each process trains on one of its devices, the critic included, and samples its own
    # rows on the other, the actor's weights copied between its own devices before each rollout)
    ("quickstart", [], {"two": [], "split": ["rollout.devices=2"]}),
    # one step off-policy (jppo.run.offpolicy) with the rollout mesh across the processes: on 1 device and on the 2
    # processes the next batch is generated on a thread beside the update (on the 2 processes its program,
    # collective-free, beside the update's collectives); the schedule, and so every metric, is the same, and so is
    # the resumed weight queue
    ("quickstart_grpo", ["trainer.off_policy_steps=1"], {"two": ["rollout.devices=2"]}),
], ids=["ppo-and-ppo-rollout-devices", "grpo-off-policy-1-rollout-devices"])
def test_two_processes_of_two_devices_match_one_device_and_resume_on_it(tmp_path, config, extra, layouts):
    """The whole-run contract across hosts: 2 processes x 2 devices (4 batch shards; or 2 training and 2 rollout
    devices) train the same two steps as 1 process on 1 device, and the 2-process checkpoint of run ``two``
    continues on the single device exactly like the single-device run."""
    path = str(ROOT / "configs" / f"{config}.yaml")
    pairs = {}
    for name, layout in layouts.items():
        port = free_port()
        pairs[name] = [
            train(f"trainer.output_dir={tmp_path / name}", "trainer.total_steps=2", *extra, *layout,
                  *(["trainer.export_hf=true"] if name == "two" else []), "--coordinator", f"localhost:{port}",
                  "--num-processes", "2", "--process-id", str(i), devices=2, config=path)
            for i in (1, 0)
        ]
    one = train(f"trainer.output_dir={tmp_path / 'one'}", "trainer.total_steps=3", *extra, devices=1, config=path)
    outputs = {name: [finish(process) for process in processes] for name, processes in pairs.items()}
    finish(one)
    single = metrics(tmp_path / "one")
    for name, layout in layouts.items():
        double = metrics(tmp_path / name)
        assert [row["step"] for row in double] == [1, 2] and "val/reward/mean" in double[1]
        if extra:
            assert [row["async/staleness"] for row in double] == [0, 1]
            # before, a run of several processes sampled in turn with the update
            assert all("the next rollout runs beside the update" in out for out in outputs[name]), outputs[name][1]
        if layout:  # a replica of the weights moved to the rollout devices before each rollout
            assert all(row["perf/weight_move_bytes"] > 0 for row in metrics(tmp_path / name, every_key=True))
        for a, b in zip(single[:2], double):
            assert set(a) == set(b)
            for key, value in a.items():
                # float32, four Adam updates per step: the same sums over 1 device and 2 x 2 agree to ~1e-5
                assert b[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (name, key)
    assert (tmp_path / "two" / "hf" / "model.safetensors").is_file()
    finish(train(f"trainer.output_dir={tmp_path / 'two'}", "trainer.total_steps=3", *extra, devices=1, config=path))
    resumed = metrics(tmp_path / "two")
    assert [row["step"] for row in resumed] == [1, 2, 3]
    for name, value in single[2].items():
        assert resumed[2][name] == pytest.approx(value, rel=1e-4, abs=1e-6), name


def test_bitwise_runs_on_two_processes_log_and_save_the_bits_of_one_device(tmp_path):
    """trainer.deterministic=bitwise across hosts: 2 processes x 2 devices (4 batch shards, the gradients' tree met
    across the processes, each process sampling and scoring its own rows) log every metric of two PPO steps,
    validation included, and save every checkpoint array with the bits of 1 process of 1 device. Before, each
    process's share of the rollout's and validation's float sums was added in process order."""
    import jax
    import numpy as np

    from jppo.run.checkpoint import restore_part, saved_tree

    def saved(run: str) -> list[np.ndarray]:
        """Every array of the run's step-2 checkpoint, read onto this process's first device."""
        path, device = tmp_path / run / "checkpoints" / "2", jax.sharding.SingleDeviceSharding(jax.devices()[0])
        target = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=device),
                              saved_tree(path), is_leaf=lambda leaf: hasattr(leaf, "shape"))
        return [np.asarray(x) for x in jax.tree.leaves(restore_part(path, target))]

    extra = ["trainer.total_steps=2", "trainer.deterministic=bitwise", "trainer.save_every=2",
             "trainer.async_checkpoint=false"]
    flags = ["--coordinator", f"localhost:{free_port()}", "--num-processes", "2"]
    two = [train(f"trainer.output_dir={tmp_path / 'two'}", *extra, *flags, "--process-id", str(i), devices=2)
           for i in (1, 0)]
    one = train(f"trainer.output_dir={tmp_path / 'one'}", *extra, devices=1)
    for process in [*two, one]:
        finish(process)
    assert metrics(tmp_path / "two") == metrics(tmp_path / "one")
    assert "val/reward/mean" in metrics(tmp_path / "one")[1]
    arrays = {name: saved(name) for name in ("one", "two")}
    assert len(arrays["two"]) == len(arrays["one"]) > 100
    assert all(np.array_equal(a, b) for a, b in zip(arrays["two"], arrays["one"]))


TRAINED = ("actor/", "critic/")  # what the updates compute, the same sums on the same mesh in any process layout
# A process of `python -m jppo.train` that sends itself SIGTERM at a point of a step (tests/signals.py); arguments:
# the tests folder, the step, the point, then the command's own.
SIGNALLED = textwrap.dedent(
    """
    import signal, sys
    import pytest
    sys.path.insert(0, sys.argv[1])
    from signals import signal_at
    signal_at(pytest.MonkeyPatch(), int(sys.argv[2]), sys.argv[3], signal.SIGTERM)
    from jppo.train import main
    sys.exit(main(sys.argv[4:]))
    """
)


def test_two_processes_of_one_device_stop_together_on_one_sigterm_and_resume_bitwise(tmp_path):
    """The layout of a GPU cluster run with a process per GPU: 2 processes of 1 device each (their checkpoints once
    failed in orbax). SIGTERM reaches process 1 alone, at a seeded random point of step 2 of a PPO run one step
    off-policy (step 3's batch, regenerated after the resume, comes from the trained weights the queue holds); both
    processes save that step without validating it (they agree at each step boundary) and exit 75; the same command
    resumes, and the run trains what one process of 2 devices, the same mesh, trains uninterrupted, bit for bit."""
    from signals import SIGNAL_POINTS

    step, point = 2, random.Random(43).choice(SIGNAL_POINTS[:-1])  # no periodic save: the stop saves
    extra = ["trainer.total_steps=3", "trainer.off_policy_steps=1", "trainer.save_every=0", "trainer.export_hf=true"]
    out = f"trainer.output_dir={tmp_path / 'two'}"

    def pair(signalled: bool) -> list[subprocess.Popen]:
        flags = ["--coordinator", f"localhost:{free_port()}", "--num-processes", "2"]
        processes = []
        for i in (0, 1):
            command = (["-c", SIGNALLED, str(ROOT / "tests"), str(step), point] if signalled and i
                       else ["-m", "jppo.train"])
            processes.append(subprocess.Popen(
                [sys.executable, *command, *flags, "--process-id", str(i), "--config", CONFIG, *SMALL, out, *extra],
                cwd=ROOT, env=env(1, optimized=False), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        return processes

    # at the suite's optimization level (compiling about a third faster): what is checked here is when the processes
    # stop and what they resume from; the optimized programs of a user's run are the matching tests' above
    stopped = pair(signalled=True)
    one = train(f"trainer.output_dir={tmp_path / 'one'}", *extra, devices=2, optimized=False)
    outputs = [process.communicate(timeout=600)[0] for process in stopped]
    assert [process.returncode for process in stopped] == [75, 75], outputs[1][-3000:]
    assert f"jppo.train: stopped on another process's signal after step {step}, checkpointed;" in outputs[0]
    assert re.search(rf"jppo.train: stopped on SIGTERM after step {step}, checkpointed [0-9.]+ s after", outputs[1])
    assert [row["step"] for row in metrics(tmp_path / "two")] == list(range(1, step + 1))
    assert sorted(p.name for p in (tmp_path / "two" / "checkpoints").iterdir()) == [str(step)]  # committed, no -tmp
    for process in pair(signalled=False):
        finish(process)
    finish(one)
    policy = [(tmp_path / run / "hf" / "model.safetensors").read_bytes() for run in ("two", "one")]
    assert policy[0] == policy[1]  # the trained weights, bit for bit
    resumed, uninterrupted = metrics(tmp_path / "two"), metrics(tmp_path / "one")
    assert [row["step"] for row in resumed] == [1, 2, 3]
    assert any(key.startswith("val/") for key in uninterrupted[step - 1])
    for a, b in zip(resumed, uninterrupted):
        if a["step"] == step:  # a stopping step saves without validating (a validation could outlast the grace)
            b = {k: v for k, v in b.items() if not k.startswith("val/")}
        assert set(a) == set(b)
        assert ({k: v for k, v in a.items() if k.startswith(TRAINED)}
                == {k: v for k, v in b.items() if k.startswith(TRAINED)})
        for name, value in b.items():
            # batch means over the rows of both processes are summed per process first: float32 rounding (~1e-7)
            assert a[name] == pytest.approx(value, rel=1e-6, abs=1e-7), name


@pytest.mark.parametrize(
    "args,message",
    [
        (["--num-processes", "2", "--process-id", "5"], "--process-id=5 must be in [0, 2)"),
        (["--process-id", "1", "--num-processes", "2", "--init-timeout", "3"], "could not reach the coordinator"),
        (["--process-id", "0", "--num-processes", "2", "--init-timeout", "3"],
         "processes [1] of --num-processes=2 never arrived"),
    ],
)
def test_bad_start_up_fails_fast_with_one_line(args, message):
    result = subprocess.run(
        [sys.executable, "-m", "jppo.train", "--config", CONFIG, "--coordinator", f"localhost:{free_port()}", *args],
        cwd=ROOT, env=env(4), capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr


def script(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "tpu_scripts" / name), *args], capture_output=True, text=True, timeout=60)


def test_tpu_scripts_dry_run_print_the_gcloud_commands():
    created = script("create.sh", "--name", "jppo-pod", "--zone", "us-central2-b", "--accelerator-type", "v4-32",
                     "--dry-run")
    assert created.returncode == 0
    assert "gcloud compute tpus tpu-vm create jppo-pod --zone us-central2-b --accelerator-type v4-32" in created.stdout
    queued = script("create.sh", "--name", "q", "--zone", "z", "--accelerator-type", "v5litepod-16", "--queued",
                    "--spot", "--dry-run")
    assert ("gcloud compute tpus queued-resources create q --node-id q --zone z --accelerator-type v5litepod-16"
            in queued.stdout)
    assert "--spot" in queued.stdout
    setup = script("setup.sh", "--name", "jppo-pod", "--zone", "z", "--repo", "https://example.org/jppo.git",
                   "--dry-run")
    assert "gcloud compute tpus tpu-vm ssh jppo-pod --zone z --worker=all --command" in setup.stdout
    assert "~/jppo\\'\\[tpu\\]\\'" in setup.stdout  # jppo's tpu extra: jax[tpu] of the line its Python selects
    with_data = script("setup.sh", "--name", "p", "--zone", "z", "--repo", "https://example.org/jppo.git",
                       "--gcs-data", "gs://bucket/data/", "--dry-run")
    # the prefix's contents land in the data directory itself, not in a nested data/data
    assert "gcloud\\ storage\\ rsync\\ --recursive\\ gs://bucket/data\\ ~/data" in with_data.stdout
    launch = script("launch.sh", "--name", "jppo-pod", "--zone", "z", "--config", "configs/quickstart.yaml",
                    "--collect", "/tmp/logs", "--dry-run", "--", "trainer.total_steps=5")
    assert "--worker=all" in launch.stdout and "jppo.train" in launch.stdout
    assert "--distributed\\ auto\\ trainer.total_steps=5" in launch.stdout
    assert "gcloud compute tpus tpu-vm scp" in launch.stdout
    deleted = script("delete.sh", "--name", "jppo-pod", "--zone", "z", "--dry-run")
    assert "gcloud compute tpus tpu-vm delete jppo-pod --zone z --quiet" in deleted.stdout


@pytest.mark.parametrize(
    "name,args,message",
    [
        ("create.sh", ["--zone", "z", "--accelerator-type", "v4-8"], "missing --name"),
        ("create.sh", ["--name", "n", "--zone", "z", "--accelerator-type", "v4-8", "--bogus"],
         "unknown argument --bogus"),
        ("setup.sh", ["--name", "n", "--zone", "z"], "give exactly one of --repo URL or --copy DIR"),
        ("launch.sh", ["--name", "n", "--zone", "z"], "missing --config"),
        ("create.sh", ["--name", "n", "--zone", "z", "--accelerator-type", "v4-8"], "gcloud is not installed"),
        # an option without its value, or with another option in its place (which would then run for real)
        ("create.sh", ["--name"], "--name needs a value"),
        ("launch.sh", ["--name", "n", "--zone", "z", "--config", "c.yaml", "--collect", "--dry-run"],
         "--collect needs a value"),
        ("multinode.sh", ["--coordinator"], "--coordinator needs a value"),
    ],
)
def test_tpu_scripts_reject_bad_arguments(tmp_path, name, args, message):
    # A PATH with only the two tools the scripts need besides bash: gcloud is surely absent, so nothing real runs.
    for tool in ("basename", "dirname"):
        (tmp_path / tool).symlink_to(shutil.which(tool))
    result = subprocess.run([shutil.which("bash"), str(ROOT / "tpu_scripts" / name), *args], capture_output=True,
                            text=True, timeout=60, env={"PATH": str(tmp_path)})
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_tpu_scripts_have_help():
    for name in ("create.sh", "setup.sh", "launch.sh", "delete.sh"):
        result = script(name, "--help")
        assert result.returncode == 0 and "usage:" in result.stdout and "--dry-run" in result.stdout


def slurm_env(tasks_per_node: int, nodes: int = 4, node: int = 2, local: int = 0, gpus: str = "0,1,2,3,4,5,6,7"):
    """What srun sets for a task (one of ``tasks_per_node`` on each of ``nodes``) on a node of 8 GPUs."""
    return {
        "SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": f"gpu[001-{nodes:03d}]",
        "SLURM_NTASKS": str(nodes * tasks_per_node),
        "SLURM_PROCID": str(node * tasks_per_node + local), "SLURM_LOCALID": str(local), "SLURM_NODEID": str(node),
        "SLURM_STEP_NUM_NODES": str(nodes), "SLURM_STEP_TASKS_PER_NODE": f"{tasks_per_node}(x{nodes})",
        "SLURM_GPUS_ON_NODE": "8", "CUDA_VISIBLE_DEVICES": gpus,
    }


def start_args(*argv: str):
    parser = argparse.ArgumentParser()
    distributed.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_one_slurm_task_per_node_drives_all_eight_gpus(monkeypatch):
    for name in [n for n in os.environ if n.startswith(("SLURM_", "JAX_"))] + ["CUDA_VISIBLE_DEVICES"]:
        monkeypatch.delenv(name, raising=False)
    for name, value in slurm_env(tasks_per_node=1).items():
        monkeypatch.setenv(name, value)
    kwargs = distributed.settings(start_args("--distributed", "auto"))
    assert kwargs["local_device_ids"] == list(range(8))
    # JAX's own SLURM detection keeps them; without them it gives the process GPU SLURM_LOCALID alone
    from jax._src import clusters  # noqa: PLC0415 (what jax.distributed.initialize runs)

    detected = clusters.ClusterEnv.auto_detect_unset_distributed_params(None, None, None, None, None, 10)
    assert detected[1:] == (4, 2, [0])
    detected = clusters.ClusterEnv.auto_detect_unset_distributed_params(
        None, None, None, kwargs["local_device_ids"], None, 10
    )
    assert detected[1:] == (4, 2, list(range(8)))
    # explicit flags inside SLURM: JAX would still narrow the process to one GPU, so jppo gives the ids there too
    explicit = distributed.settings(
        start_args("--coordinator", "gpu001:8476", "--num-processes", "4", "--process-id", "2")
    )
    assert explicit["local_device_ids"] == list(range(8))
    monkeypatch.setenv("JAX_LOCAL_DEVICE_IDS", "2,3")  # the user's own choice stands
    assert distributed.settings(start_args("--distributed", "auto"))["local_device_ids"] == [2, 3]
    monkeypatch.delenv("JAX_LOCAL_DEVICE_IDS")
    # one task per GPU: task 5 drives GPU 5 (JAX's own choice); a task bound to its own GPU drives it
    for name, value in slurm_env(tasks_per_node=8, local=5).items():
        monkeypatch.setenv(name, value)
    assert distributed.settings(start_args("--distributed", "auto"))["local_device_ids"] == [5]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    assert distributed.settings(start_args("--distributed", "auto"))["local_device_ids"] == [0]
    for name, value in slurm_env(tasks_per_node=3).items():
        monkeypatch.setenv(name, value)
    with pytest.raises(distributed.DistributedError, match="3 tasks on this node, which sees 8 GPUs"):
        distributed.settings(start_args("--distributed", "auto"))


def test_dry_run_prints_processes_local_devices_and_mesh():
    clean = {k: v for k, v in env(1).items() if not k.startswith(("SLURM_", "JAX_COORD", "JAX_NUM", "JAX_PROCESS"))}
    result = subprocess.run(
        [sys.executable, "-m", "jppo.train", "--config", CONFIG, "--distributed", "dry-run", "mesh.data=-1",
         "mesh.tensor=8"],
        cwd=ROOT, env={**clean, **slurm_env(tasks_per_node=1)}, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "processes: 4; this process: 2" in out and "local device ids: 0,1,2,3,4,5,6,7" in out
    assert "mesh (data, fsdp, tensor, sequence, expert): (4, 1, 8, 1, 1) over 32 devices" in out


class _Metadata(http.server.BaseHTTPRequestHandler):
    """A GCE metadata server on the loopback: the instance attributes of worker 1 of a 4-worker TPU slice, answered
    only with the header JAX and jppo send."""

    attributes = {"worker-network-endpoints": "t1k:w-0:10.0.0.2,t1k:w-1:10.0.0.3,t1k:w-2:10.0.0.4,t1k:w-3:10.0.0.5",
                  "agent-worker-number": "1"}

    def do_GET(self):
        key = self.path.rpartition("/")[2]
        if self.headers.get("Metadata-Flavor") != "Google" or key not in self.attributes:
            self.send_response(404)
            self.end_headers()
            return
        body = self.attributes[key].encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture()
def metadata_server():
    server = http.server.HTTPServer(("127.0.0.1", 0), _Metadata)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def fake_pci(root: pathlib.Path, devices: dict[str, tuple[str, str]]) -> str:
    for slot, (vendor, device) in devices.items():
        (root / slot).mkdir(parents=True)
        (root / slot / "vendor").write_text(vendor + "\n")
        (root / slot / "device").write_text(device + "\n")
    return str(root)


def test_tpu_chips_are_counted_on_the_pci_bus_and_a_gvnic_is_not_one(tmp_path):
    # a v5e-4 host's four chips and its gVNIC (Google's vendor id too), an NVIDIA GPU; none on a plain machine
    pci = fake_pci(tmp_path / "pci", {"0000:00:04.0": ("0x1ae0", "0x0042"), "0000:00:05.0": ("0x10de", "0x2335"),
                                      **{f"0000:00:0{i + 6}.0": ("0x1ae0", "0x0063") for i in range(4)}})
    assert distributed.tpu_chips(pci) == 4
    assert distributed.tpu_chips(fake_pci(tmp_path / "gpu", {"0000:00:04.0": ("0x1ae0", "0x0042")})) == 0
    assert distributed.tpu_chips(str(tmp_path / "absent")) == 0


def test_a_gce_tpu_pod_is_found_through_the_metadata_server(monkeypatch, metadata_server, tmp_path):
    for name in [n for n in os.environ if n.startswith(("SLURM_", "JAX_", "TPU_"))]:
        monkeypatch.delenv(name, raising=False)
    environ = {"GCE_METADATA_IP": metadata_server}
    assert distributed.gce_tpu_workers(environ, on_tpu_vm=True) == (["10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5"], 1)
    # off a TPU VM nothing is asked; where JAX found no chip (TPU_SKIP_MDS_QUERY) neither
    assert distributed.gce_tpu_workers(environ, on_tpu_vm=False) is None
    assert distributed.gce_tpu_workers({**environ, "TPU_SKIP_MDS_QUERY": "1"}, on_tpu_vm=True) is None
    # no server (a closed port): None within the timeout, not a hang
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    assert distributed.gce_tpu_workers({"GCE_METADATA_IP": f"127.0.0.1:{port}"}, on_tpu_vm=True) is None
    # so a command with no process flags on a pod's worker starts JAX's cluster detection (train, eval and audit
    # alike), and the dry run names the pod's size and this worker, as JAX will number them
    monkeypatch.setenv("GCE_METADATA_IP", metadata_server)
    monkeypatch.setattr(distributed, "PCI_DEVICES", fake_pci(tmp_path, {"0000:00:05.0": ("0x1ae0", "0x005e")}))
    assert distributed.settings(start_args()) == {}
    start = distributed.process_start(start_args("--distributed", "dry-run"))
    assert (start.num_processes, start.process_id) == (4, 1)
    from jax._src.clusters import cloud_tpu_cluster  # noqa: PLC0415 (the detection jax.distributed.initialize runs)

    for key, value in _Metadata.attributes.items():  # JAX's own reading of the same server agrees
        assert cloud_tpu_cluster.get_metadata(key)[0] == value
    # one worker (a single-host TPU VM): one process, as before
    monkeypatch.setitem(_Metadata.attributes, "worker-network-endpoints", "t1k:w-0:10.0.0.2")
    assert distributed.settings(start_args()) is None


@pytest.mark.parametrize("command", ["eval", "audit"])
def test_eval_and_audit_take_the_process_flags_of_train(command):
    module = __import__(f"jppo.{command}", fromlist=["parse_args"])
    args = module.parse_args(["--config", CONFIG, "--coordinator", "h:1234", "--num-processes", "2", "--process-id",
                              "1", "--distributed", "auto", "--init-timeout", "5"])
    assert distributed.settings(args) == {"coordinator_address": "h:1234", "num_processes": 2, "process_id": 1}


def test_sft_on_two_processes_of_two_devices_matches_one_device(tmp_path):
    """``python -m jppo.sft`` across hosts: 2 processes x 2 devices (4 batch shards, each process reading its own
    rows of every step) log the metrics, held-out loss included, that 1 process on 1 device logs."""
    quiet = ["trainer.plots=false", "trainer.logger=[jsonl]", "trainer.progress_bar=false", "trainer.total_steps=2",
             "trainer.val_every=2", "trainer.val_before_train=false", "trainer.export_hf=false",
             "data.num_val_examples=32"]

    def sft(out: pathlib.Path, *args: str, devices: int) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "jppo.sft", "--config", str(ROOT / "configs" / "quickstart_sft.yaml"), *quiet,
             f"trainer.output_dir={out}", *args], cwd=ROOT, env=env(devices), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)

    port = free_port()
    two = [sft(tmp_path / "two", "--coordinator", f"localhost:{port}", "--num-processes", "2", "--process-id", str(i),
               devices=2) for i in (1, 0)]
    one = sft(tmp_path / "one", devices=1)
    for process in [*two, one]:
        finish(process)
    single, double = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert [row["step"] for row in double] == [1, 2] and "val/sft_nll" in double[1]
    for a, b in zip(single, double):
        assert set(a) == set(b)
        for name, value in a.items():
            assert b[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name
