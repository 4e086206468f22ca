"""The TPU / GPU launch scripts: they parse (``bash -n``), pick the runtime version the Cloud TPU docs name for each
generation, wait for a queued resource to be ACTIVE, set up a Python >= 3.11 environment with uv, and start a run
that outlives its ssh, with the flags of ``xla_flags.sh``. ``gcloud`` is a stand-in on PATH that records its
arguments and, for ``tpu-vm ssh``, runs the command on this machine as one worker would."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import signal
import subprocess
import time

import pytest

from jppo.parallel.preemption import PREEMPTED_EXIT, SIGNALS

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tpu_scripts"

# The stand-in: every call appended to $GCLOUD_LOG; `queued-resources describe` answers the next line of $STATES;
# `tpu-vm ssh ... --command CMD` runs CMD in bash with HOME=$WORKER_HOME (one worker of the slice).
FAKE_GCLOUD = r"""#!/usr/bin/env bash
printf '%s\n' "$*" >> "$GCLOUD_LOG"
if [[ "$*" == "compute tpus queued-resources describe"* ]]; then
  head -n 1 "$STATES"; sed -i 1d "$STATES"; exit 0
fi
if [[ "$*" == "compute tpus tpu-vm ssh"* ]]; then
  while [[ $# -gt 0 && "$1" != --command ]]; do shift; done
  HOME="$WORKER_HOME" exec bash -c "$2"
fi
"""


@pytest.fixture()
def gcloud(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "gcloud").write_text(FAKE_GCLOUD)
    (bin_dir / "gcloud").chmod(0o755)
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "GCLOUD_LOG": str(tmp_path / "gcloud.log"),
        "STATES": str(tmp_path / "states"), "WORKER_HOME": str(tmp_path / "worker"), "JPPO_TPU_POLL_SECONDS": "0",
    }
    (tmp_path / "worker").mkdir()
    return env


def script(name: str, *args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPTS / name), *args], capture_output=True, text=True, timeout=timeout,
                          env=None if env is None else {**os.environ, **env})


def test_every_script_parses():
    for path in sorted(SCRIPTS.glob("*.sh")) + [SCRIPTS / "gpu_slurm.sbatch"]:
        result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert result.returncode == 0, (path.name, result.stderr)


@pytest.mark.parametrize("accelerator,version", [
    ("v6e-8", "v2-alpha-tpuv6e"), ("v5p-8", "v2-alpha-tpuv5"), ("v5litepod-16", "v2-alpha-tpuv5-lite"),
    ("v4-32", "tpu-ubuntu2204-base"), ("v3-8", "tpu-ubuntu2204-base"),
])
def test_create_picks_the_runtime_version_of_each_generation(accelerator, version):
    result = script("create.sh", "--name", "n", "--zone", "z", "--accelerator-type", accelerator, "--dry-run")
    assert result.returncode == 0, result.stderr
    assert f"--version {version}" in result.stdout
    queued = script("create.sh", "--name", "n", "--zone", "z", "--accelerator-type", accelerator, "--queued",
                    "--dry-run")
    assert f"--runtime-version {version}" in queued.stdout


def test_create_refuses_a_generation_it_has_no_version_for():
    result = script("create.sh", "--name", "n", "--zone", "z", "--accelerator-type", "tpu9x-4", "--dry-run")
    assert result.returncode == 2 and "no default software version for --accelerator-type tpu9x-4" in result.stderr


def test_a_queued_resource_is_polled_until_active(gcloud, tmp_path):
    (tmp_path / "states").write_text("ACCEPTED\nWAITING_FOR_RESOURCES\nPROVISIONING\nACTIVE\n")
    result = script("create.sh", "--name", "q", "--zone", "z", "--accelerator-type", "v6e-16", "--queued",
                    env=gcloud)
    assert result.returncode == 0, result.stderr
    assert "q is ACTIVE" in result.stdout
    calls = (tmp_path / "gcloud.log").read_text().splitlines()
    assert calls[0].startswith("compute tpus queued-resources create q --node-id q")
    assert sum("queued-resources describe q" in call for call in calls) == 4  # until ACTIVE, not one more
    (tmp_path / "states").write_text("PROVISIONING\nFAILED\n")
    failed = script("create.sh", "--name", "q", "--zone", "z", "--accelerator-type", "v6e-16", "--queued", env=gcloud)
    assert failed.returncode == 2 and "queued resource q is FAILED" in failed.stderr


def test_setup_makes_a_python_3_12_environment_with_uv():
    result = script("setup.sh", "--name", "p", "--zone", "z", "--repo", "https://example.org/jppo.git", "--dry-run")
    assert result.returncode == 0, result.stderr
    command = result.stdout
    assert "uv\\ venv\\ --allow-existing\\ --python\\ 3.12\\ ~/jppo-venv" in command
    assert "uv\\ pip\\ install\\ --python\\ ~/jppo-venv/bin/python\\ -e\\ ~/jppo\\'\\[tpu\\]\\'" in command
    assert "python3\\ -m\\ pip\\ install\\ -e" not in command  # the image's Python 3.10 installs nothing of jppo
    old = script("setup.sh", "--name", "p", "--zone", "z", "--repo", "u", "--python", "3.10", "--dry-run")
    assert old.returncode == 2 and "jppo needs Python 3.11 or later" in old.stderr


def test_launch_outlives_its_ssh_logs_per_worker_and_expands_home_on_the_worker(gcloud, tmp_path):
    # the worker's code directory and environment: a "python" that reports what it was started with, then runs on
    code, venv = tmp_path / "worker" / "jppo", tmp_path / "worker" / "jppo-venv" / "bin"
    shutil.copytree(SCRIPTS, code / "tpu_scripts")
    venv.mkdir(parents=True)
    (venv / "python").write_text('#!/usr/bin/env bash\necho "args: $*"\necho "xla: $XLA_FLAGS"\n'
                                 'echo "session: $(ps -o sid= $$) $(ps -o sid= $PPID)"\nsleep 3\necho finished\n')
    (venv / "python").chmod(0o755)
    started = time.monotonic()
    result = script("launch.sh", "--name", "p", "--zone", "z", "--config", "configs/quickstart.yaml", "--",
                    "model.path=$HOME/qwen", "trainer.total_steps=5", env={**gcloud, "JPPO_BACKEND": "gpu"})
    assert result.returncode == 0, result.stderr
    assert time.monotonic() - started < 3, "launch waited for the run instead of detaching it"
    host = subprocess.run(["hostname"], capture_output=True, text=True).stdout.strip()
    log, pid = (tmp_path / "worker" / "jppo-logs" / f"worker-{host}.log",
                tmp_path / "worker" / "jppo-logs" / f"worker-{host}.pid")
    assert f"started, pid {pid.read_text().strip()}" in result.stdout
    deadline = time.monotonic() + 30
    while "finished" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    out = log.read_text()
    assert "finished" in out  # it ran to its end after the ssh (here: the stand-in's bash) had returned
    home = tmp_path / "worker"
    assert f"args: -m jppo.train --config configs/quickstart.yaml --distributed auto model.path={home}/qwen " \
           "trainer.total_steps=5" in out
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in out
    session = out.split("session: ")[1].split()[0]
    # its own session (led by resume_loop.sh, the pid launch.sh reports), not the ssh's: a hang-up never reaches it
    assert session == pid.read_text().strip() != str(os.getsid(0))


def test_logs_follows_one_worker_without_touching_the_run():
    result = script("logs.sh", "--name", "p", "--zone", "z", "--worker", "3", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "--worker=3 --command tail\\ -n\\ +1\\ -F\\ ~/jppo-logs/worker-3.log" in result.stdout
    assert script("logs.sh", "--help").returncode == 0


@pytest.mark.parametrize("backend,variable,flag", [
    ("gpu", "XLA_FLAGS", "--xla_gpu_enable_pipelined_all_gather"),
    ("tpu", "LIBTPU_INIT_ARGS", "--xla_tpu_enable_async_collective_fusion"),
])
def test_xla_flags_add_only_what_the_user_did_not_set(backend, variable, flag):
    def sourced(**env):
        command = f"set -euo pipefail; source {SCRIPTS / 'xla_flags.sh'}; echo \"${{{variable}:-}}\"; " \
                  "echo \"${XLA_PYTHON_CLIENT_MEM_FRACTION:-unset}\""
        clean = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "LIBTPU_INIT_ARGS",
                                                                    "XLA_PYTHON_CLIENT_MEM_FRACTION")}
        out = subprocess.run(["bash", "-c", command], capture_output=True, text=True, env={**clean, **env}, check=True)
        return out.stdout.splitlines()

    flags, fraction = sourced(JPPO_BACKEND=backend)
    assert f"{flag}=true" in flags.split()
    assert fraction == ("0.90" if backend == "gpu" else "unset")
    mine, fraction = sourced(JPPO_BACKEND=backend, **{variable: f"{flag}=false --other=1"},
                             XLA_PYTHON_CLIENT_MEM_FRACTION="0.5")
    assert f"{flag}=false" in mine.split() and f"{flag}=true" not in mine.split() and "--other=1" in mine.split()
    assert fraction == "0.5"
    assert sourced(JPPO_BACKEND=backend, JPPO_XLA_FLAGS="off")[0] == ""
    assert sourced(JPPO_BACKEND="cpu")[0] == ""


def test_the_gpu_flags_exist_in_the_installed_xla():
    # XLA's GPU flags are in jaxlib's flag table on every platform (the TPU ones are libtpu's, not installed here)
    import jaxlib  # noqa: PLC0415

    names = subprocess.run(["bash", "-c",
                            f"source {SCRIPTS / 'xla_flags.sh'}; printf '%s\\n' \"${{JPPO_GPU_XLA_FLAGS[@]}}\""],
                           capture_output=True, text=True, check=True).stdout.split()
    assert len(names) >= 4
    libraries = sorted(pathlib.Path(jaxlib.__file__).parent.glob("*.so"), key=lambda p: -p.stat().st_size)
    # grep, not Python: the flag table's library is hundreds of MB
    found = subprocess.run(["grep", "-a", "-o", "-h", "-F", *[f"-e{n.split('=')[0].lstrip('-')}" for n in names],
                            *map(str, libraries)], capture_output=True, text=True).stdout.split()
    assert set(found) == {n.split("=")[0].lstrip("-") for n in names}, (found, [p.name for p in libraries])


def test_gpu_slurm_starts_the_run_with_the_flags_file(tmp_path):
    # srun's stand-in prints what the task would start with
    (tmp_path / "srun").write_text('#!/usr/bin/env bash\necho "xla: $XLA_FLAGS"\necho "cmd: $*"\n')
    (tmp_path / "srun").chmod(0o755)
    env = {"PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}", "SLURM_SUBMIT_DIR": str(ROOT), "JPPO_BACKEND": "gpu"}
    result = subprocess.run(["bash", str(SCRIPTS / "gpu_slurm.sbatch"), "configs/quickstart.yaml", "mesh.fsdp=-1"],
                            capture_output=True, text=True, env={**os.environ, **env}, timeout=60, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in result.stdout
    assert "cmd: --kill-on-bad-exit=1 python -m jppo.train --config configs/quickstart.yaml --distributed auto " \
           "mesh.fsdp=-1" in result.stdout


def stand_in(folder: pathlib.Path, name: str, body: str) -> None:
    (folder / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
    (folder / name).chmod(0o755)


@pytest.mark.parametrize("status,requeued", [(PREEMPTED_EXIT, True), (3, False), (0, False)])
def test_gpu_slurm_requeues_a_run_stopped_on_its_signal(tmp_path, status, requeued):
    """The signal the sbatch header asks SLURM for is one jppo stops on; a run that stopped on it (exit 75) is queued
    again (and resumes), any other status is the job's."""
    header = (SCRIPTS / "gpu_slurm.sbatch").read_text()
    sent = re.search(r"^#SBATCH --signal=(\w+)@(\d+)$", header, re.MULTILINE)
    assert sent and getattr(signal, f"SIG{sent[1]}") in SIGNALS and "#SBATCH --requeue" in header
    stand_in(tmp_path, "srun", f"exit {status}")
    stand_in(tmp_path, "scontrol", f'echo "$*" >> {tmp_path / "scontrol.log"}')
    env = {"PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}", "SLURM_SUBMIT_DIR": str(ROOT), "SLURM_JOB_ID": "4242"}
    result = subprocess.run(["bash", str(SCRIPTS / "gpu_slurm.sbatch"), "configs/quickstart.yaml"], capture_output=True,
                            text=True, env={**os.environ, **env}, timeout=60, cwd=tmp_path)
    assert result.returncode == (0 if requeued else status), result.stderr
    log = tmp_path / "scontrol.log"
    assert (log.read_text() if log.exists() else "") == ("requeue 4242\n" if requeued else "")


def test_launch_starts_a_run_stopped_on_a_signal_again_until_told_to_stop(tmp_path):
    """resume_loop.sh (what launch.sh runs on each worker): exit 75 starts the run again, another status ends the
    loop with it, and a stop file (delete.sh --stop-only) ends it after the stop."""
    count = tmp_path / "count"
    # the run's stand-in: stopped by a signal twice (75), then done (0)
    stand_in(tmp_path, "run",
             f'echo x >> {count}; n=$(wc -l < {count}); [[ $n -ge 3 ]] && exit 0; exit {PREEMPTED_EXIT}')
    result = script("resume_loop.sh", str(tmp_path / "stop"), str(tmp_path / "run"))
    assert result.returncode == 0 and count.read_text().count("x") == 3, result.stdout
    assert result.stdout.count("starting again to resume") == 2
    count.unlink()
    (tmp_path / "stop").touch()
    result = script("resume_loop.sh", str(tmp_path / "stop"), str(tmp_path / "run"))
    assert result.returncode == PREEMPTED_EXIT and count.read_text().count("x") == 1
    stopped = script("delete.sh", "--name", "p", "--zone", "z", "--stop-only", "--dry-run")
    assert "touch\\ \\\"\\$\\{f%.log\\}.stop\\\"" in stopped.stdout and "pkill" in stopped.stdout
