"""The suite's own safety net (tests/worker_crashes.py), run on a small suite of its own in one xdist worker: a
worker that dies of a segfault mid-file ends the run in seconds, not at CI's limit, and the run passes only if the
crashed test then passes alone."""

import os
import pathlib
import subprocess
import sys

import pytest

TESTS = pathlib.Path(__file__).resolve().parent

# One file's middle test crashes, then a file of one test: each once ("once"), or every time, alone too ("always").
# With xdist's own scheduler the second stalled the run: the replacement worker was handed the crashed test alone,
# and a worker runs a test only once it knows the next one (or that none is coming).
CRASH = """
def crash(name):
    import os, pathlib, signal
    marker = pathlib.Path(os.environ["CRASH_MARKERS"]) / name
    if os.environ["CRASH"] == "always" or not marker.exists():
        marker.write_text("crashed")
        os.kill(os.getpid(), signal.SIGSEGV)
"""
SUITE = {
    "test_a.py": CRASH + "def test_a1():\n    pass\n\ndef test_a2_crashes():\n    crash('a2')\n\n"
                 "def test_a3():\n    pass\n",
    "test_b.py": CRASH + "def test_b1_crashes():\n    crash('b1')\n",
    "test_c.py": "def test_c1():\n    pass\n\ndef test_c2():\n    pass\n",
    "conftest.py": "from worker_crashes import *  # noqa: F401,F403\n",
}


def run_suite(tmp_path: pathlib.Path, crash: str) -> subprocess.CompletedProcess:
    for name, text in SUITE.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "pytest.ini").write_text("[pytest]\ntimeout = 60\n")
    env = dict(os.environ, CRASH=crash, CRASH_MARKERS=str(tmp_path),
               PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    env.pop("JPPO_TEST_HANGS", None)  # this run's own folder for hung tests' stacks
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "1", "--dist", "loadfile",
               "--no-loadscope-reorder", "--max-worker-restart=4", "-o", "addopts=", "."]
    # a stalled run is this test failing, not this test hanging (it ends in ~10 s)
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_a_worker_that_crashes_once_mid_file_ends_the_run_and_it_passes_after_the_test_passes_alone(tmp_path):
    done = run_suite(tmp_path, crash="once")
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    for crashed in ("test_a.py::test_a2_crashes", "test_b.py::test_b1_crashes"):
        assert f"a worker that crashed: {crashed}, rerun alone in a fresh process: passed" in out
    # every other test ran once and passed; the crashed ones are counted apart, not as failed
    assert "4 passed, 2 crashed, then passed alone" in out, out[-2000:]


def test_a_test_that_crashes_again_alone_fails_the_run(tmp_path):
    done = run_suite(tmp_path, crash="always")
    out = done.stdout + done.stderr
    assert done.returncode == pytest.ExitCode.TESTS_FAILED, out[-3000:]
    assert "rerun alone in a fresh process: FAILED" in out
    assert "2 failed, 4 passed" in out, out[-2000:]
