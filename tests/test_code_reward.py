"""reward.kind: code, and the box the model's programs run in (jppo.rewards.code, jppo.rewards.sandbox).

The adversarial programs each try one escape and print the expected output only when it worked: a score of 0 says
it did not, and the test checks on this side that nothing changed. The process limit is proven to hold (with a
bounded number of forks) before the unbounded fork bomb runs: a bomb that escaped would take the machine."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import socket
import subprocess
import tempfile
import time

import numpy as np
import pytest

from jppo.config import ConfigError, load_config
from jppo.core.inputs import CodeRewardConfig, RewardConfig
from jppo.data import get_task
from jppo.data.code_task import PROBLEMS
from jppo.data.tasks import Example
from jppo.rewards import sandbox
from jppo.rewards.code import program_score, row_tests
from jppo.rewards.reward_fn import build_reward_fn
from jppo.rewards.sandbox import Limits, run_program
from jppo.rewards.workers import Guarded

ROOT = pathlib.Path(__file__).resolve().parents[1]
FAST = CodeRewardConfig(cpu_s=2, wall_s=4, output_kb=64)
OK = Example("p", json.dumps({"inputs": [""], "outputs": ["ok\n"]}))  # passed when the program prints ok


def fenced(program: str) -> str:
    return f"Here it is:\n```python\n{program}\n```\n"


def nobody_processes() -> int:
    return sum(1 for pid in filter(str.isdigit, os.listdir("/proc")) if _uid(pid) == sandbox.NOBODY)


def _uid(pid: str):
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def test_a_program_scores_the_fraction_of_its_tests_or_all_or_nothing():
    example = Example("p", json.dumps({"inputs": ["1 2\n", "5 5\n"], "outputs": ["3\n", "10\n"]}))
    right = fenced("print(sum(map(int, input().split())))")
    half = fenced("a, b = map(int, input().split())\nprint(3 if a == 1 else 0)")
    assert program_score(right, example, FAST) == 1.0
    assert program_score(half, example, FAST) == 0.5
    assert program_score(half, example, CodeRewardConfig(score="all", cpu_s=2, wall_s=4)) == 0.0
    assert program_score("no fenced block", example, FAST) == 0.0
    # the last block is the program; trailing spaces and empty lines do not count
    assert program_score(fenced("print(0)") + fenced("print(sum(map(int, input().split())), ' ')\nprint()"),
                         example, FAST) == 1.0
    asserts = Example("p", json.dumps(["assert f(2) == 4", "assert f(3) == 9", "assert f(0) == 1"]))
    assert program_score(fenced("def f(x):\n    return x * x"), asserts, FAST) == pytest.approx(2 / 3)
    text_asserts = Example("p", "assert f(1) == 1\nassert f(2) == 4\n")
    assert program_score(fenced("def f(x):\n    return x * x"), text_asserts, FAST) == 1.0
    with pytest.raises(ValueError, match="fn_name='solve'"):
        row_tests(json.dumps({"fn_name": "solve", "inputs": [[1]], "outputs": [1]}))
    with pytest.raises(ValueError, match="holds no tests"):
        row_tests("42")


def test_the_built_in_task_is_scored_by_running_its_programs_in_reward_workers():
    task = get_task("write_program", {"tests": 2, "open_block": True})
    examples = task.examples("train", 8, seed=0)
    solutions = {"sum": "print(sum(map(int, input().split())))", "reverse": "print(input().strip()[::-1])",
                 "max": "print(max(map(int, input().split())))", "count": "print(len(input().split()))"}
    kinds = [next(k for k, (what, _) in sorted(PROBLEMS.items()) if what in e.prompt) for e in examples]
    responses = [solutions[k] + "\n```" for k in kinds[:4]] + ["print(1)\n```"] * 4  # the prompt opened the block
    cfg = RewardConfig(kind="code", workers=2, code=FAST)
    in_process = build_reward_fn(dataclasses.replace(cfg, workers=0), task)
    reward = Guarded(build_reward_fn(cfg, task), cfg, ("write_program", {"tests": 2, "open_block": True}))
    try:
        values = reward(responses, examples, [True] * 8)
    finally:
        reward.close()
    np.testing.assert_array_equal(values[:4], 1.0)
    assert (values[4:] < 1).all()
    np.testing.assert_array_equal(values, in_process(responses, examples, [True] * 8))
    with pytest.raises(ConfigError, match="reward.kind='task' cannot score data.task='write_program'"):
        load_config(ROOT / "configs" / "quickstart_code.yaml", ["reward.kind=task"])


def test_the_process_limit_holds_in_the_box_before_a_fork_bomb_runs():
    # bounded: 200 forks, each child asleep; the box's user may hold `processes` tasks at most
    counted = run_program(
        "import os, time\nmade = 0\nfor _ in range(200):\n    try:\n        pid = os.fork()\n    except OSError:\n"
        "        break\n    if pid == 0:\n        time.sleep(30)\n        os._exit(0)\n    made += 1\nprint(made)\n",
        limits=Limits(cpu_s=5, wall_s=8, processes=16))
    assert counted.ok and 0 < int(counted.stdout) < 16, counted
    time.sleep(0.2)
    assert nobody_processes() == 0  # the sleeping children died with the box's first process
    # now the unbounded bomb: scored 0, the box killed by its clock, nothing of it left
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\nprint('ok')"
    start = time.monotonic()
    assert program_score(fenced(bomb), OK, FAST) == 0.0
    assert time.monotonic() - start < 30
    time.sleep(0.2)
    assert nobody_processes() == 0


@pytest.fixture
def listening():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    yield server.getsockname()[1]
    server.close()


def test_escapes_score_zero_and_change_nothing(tmp_path, monkeypatch, listening):
    cwd_file, keep = pathlib.Path.cwd() / "PWNED_BY_THE_BOX", tmp_path / "keep.txt"
    keep.write_text("kept")
    tmp_path.chmod(0o777)
    keep.chmod(0o666)
    home = pathlib.Path(os.path.expanduser("~")) / "PWNED_BY_THE_BOX"
    monkeypatch.setenv("JPPO_SECRET_TOKEN", "s3cret")
    escapes = {
        "an infinite loop": "while True:\n    pass",
        "allocating 10 GB": "x = bytearray(10 * 2**30)\nprint('ok')",
        "writing in the trainer's working directory": f"open({str(cwd_file)!r}, 'w').write('x')\nprint('ok')",
        "writing in $HOME": f"open({str(home)!r}, 'w').write('x')\nprint('ok')",
        "reading the trainer's environment": "import os\nprint('ok' if os.environ.get('JPPO_SECRET_TOKEN') else '')",
        "a socket to 127.0.0.1": f"import socket\nsocket.create_connection(('127.0.0.1', {listening}), 2)\nprint('ok')",
        "deleting a file": f"import os\nos.remove({str(keep)!r})\nprint('ok')",
        "printing a gigabyte": "import sys\nfor _ in range(2**14):\n    sys.stdout.write('x' * 2**16)\nprint('ok')",
        "a segfault by ctypes": "import ctypes\nctypes.string_at(0)\nprint('ok')",
    }
    for what, program in escapes.items():
        start = time.monotonic()
        assert program_score(fenced(program), OK, FAST) == 0.0, what
        assert time.monotonic() - start < 20, what
    assert not cwd_file.exists() and not home.exists()
    assert keep.read_text() == "kept"
    assert program_score(fenced("print('ok')"), OK, FAST) == 1.0  # the box itself works


def test_a_user_without_root_gets_the_same_box_from_a_user_namespace():
    # the launcher run as an unprivileged user (nobody): namespaces from a user namespace, the same limits
    folder = pathlib.Path(tempfile.mkdtemp(dir="/tmp"))  # where nobody can read it (pytest's folders are 0700)
    folder.chmod(0o755)
    launcher = folder / "sandbox.py"
    shutil.copy(sandbox.__file__, launcher)
    launcher.chmod(0o644)
    python = sandbox.box_python()
    request = {"source": "import os, socket\nopen('/tmp/left_behind', 'w').write('x')\nprint(os.getpid())\n"
                         "socket.create_connection(('127.0.0.1', 22), 2)",
               "stdin": "", "limits": dataclasses.asdict(Limits(cpu_s=2, wall_s=4)), "python": python,
               "network": "deny"}
    done = subprocess.run([python, "-I", str(launcher)], input=json.dumps(request), capture_output=True, text=True,
                          user=sandbox.NOBODY, group=sandbox.NOBODY, env={}, timeout=60)
    shutil.rmtree(folder)
    assert done.stdout, done.stderr[-2000:]
    reply = json.loads(done.stdout)
    assert reply["status"] == "exited" and reply["stdout"] == "1\n", reply  # the first process of its own PID space
    assert "Network is unreachable" in reply["stderr"]
    assert not os.path.exists("/tmp/left_behind")


def test_a_kernel_that_cannot_box_the_network_is_refused_at_start_up_in_one_line(monkeypatch):
    import jppo.rewards.code as code

    def refused(network):
        raise OSError("this kernel refuses the box (unshare: Operation not permitted)")

    monkeypatch.setattr(code, "check_box", refused)
    with pytest.raises(ConfigError) as error:
        load_config(ROOT / "configs" / "quickstart_code.yaml", [])
    message = str(error.value)
    assert message.startswith("reward.kind='code' with reward.code.network='deny': the model's programs cannot be "
                              "boxed here (this kernel refuses the box (unshare: Operation not permitted))")
    assert "reward.code.network=allow" in message and "\n" not in message
