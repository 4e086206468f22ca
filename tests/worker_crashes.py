"""What the suite does about a test that hangs or a worker process that crashes, so that neither ends CI at its limit
with nothing said (tests/conftest.py takes these hooks).

- A hang: pytest-timeout (pyproject's ``timeout``) prints the stacks and ends the worker; one stuck below Python
  holding the GIL is ended by faulthandler's watchdog a minute later, its stacks printed in the summary.
- A crash: xdist starts a new worker (``--max-worker-restart``), the files left run on, and the test that crashed
  runs again alone in a fresh process at the end; the run passes only if every failure was such a crash and every
  rerun passed.
- xdist's file scheduler, repaired for a restarted worker (:class:`CrashSafeLoadFile`).
"""

import faulthandler
import os
import pathlib
import subprocess
import sys
import tempfile

import pytest
from xdist.scheduler import LoadFileScheduling


class CrashSafeLoadFile(LoadFileScheduling):
    """xdist's ``--dist loadfile`` scheduler, with a worker that crashed handled so the run ends.

    A worker runs a test only once it knows the next one (or that none is coming), for the fixtures' teardown. xdist
    re-queues a dead worker's file, crashed test included, and hands it to the replacement as one unit; with one test
    left in it (the file's last test crashed, or its next-to-last here) the replacement waited forever for a second,
    and the run with it: CI ran to its 90-minute limit twice this way (reproduced with a test that segfaults once).
    Here the crashed test leaves the queue (it runs again alone at the end: :func:`rerun_alone`), and a worker is
    topped up to two tests, or told that none is coming."""

    def remove_node(self, node):
        workload = self.assigned_work.pop(node)
        pending = [nodeid for unit in workload.values() for nodeid, done in unit.items() if not done]
        if not pending:  # a worker that ended normally
            return None
        crashed = pending[0]  # a worker runs its tests in the order sent: the first unreported one was running
        workload[self._split_scope(crashed)][crashed] = True
        self.workqueue.update({scope: unit for scope, unit in workload.items() if not all(unit.values())})
        for other in self.assigned_work:
            self._reschedule(other)
        return crashed

    def _reschedule(self, node):
        super()._reschedule(node)
        if node.shutting_down or node not in self.assigned_work:
            return
        while self._pending_of(self.assigned_work[node]) < 2 and self.workqueue:
            self._assign_work_unit(node)
        if self._pending_of(self.assigned_work[node]) < 2 and not self.workqueue:
            node.shutdown()  # its last test runs now: nothing follows it


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # before xdist's own (none without xdist)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") == "loadfile":
        return CrashSafeLoadFile(config, log)
    return None


# A test stuck in native code that holds the GIL is beyond pytest-timeout (pyproject's `timeout`): its thread needs the
# GIL to act, so the worker would wait forever and CI with it (CI once printed 1530 of 1539 dots, then nothing for an
# hour). faulthandler's watchdog is a C thread: a minute after pytest-timeout's limit it writes every thread's stack
# and ends the worker, whose test xdist then reports as crashed (the worker restarts, the run goes on, and the test
# runs again alone at the end: below). The stacks go to a file per worker
# (pytest captures the worker's stderr, and a process that ends that way loses it), which the summary prints.
WATCHDOG_AFTER_S = 60  # past pytest-timeout's `timeout` (900 s in pyproject; `-o timeout=N` moves both)
if "JPPO_TEST_HANGS" not in os.environ:  # the session's process makes it; its workers inherit the variable
    os.environ["JPPO_TEST_HANGS"] = tempfile.mkdtemp(prefix="jppo-test-hangs-")
HANGS = pathlib.Path(os.environ["JPPO_TEST_HANGS"])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    log = HANGS / f"worker-{os.getpid()}.txt"
    limit = float(item.config.getoption("timeout", None) or item.config.getini("timeout") or 900) + WATCHDOG_AFTER_S
    HANGS.mkdir(exist_ok=True)  # (a /tmp cleaner may have taken it: a test's bookkeeping never fails the run)
    with open(log, "w") as out:
        out.write(f"{item.nodeid} ran past {limit:g} s:\n")
        out.flush()
        faulthandler.dump_traceback_later(limit, exit=True, file=out)
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()
    log.unlink(missing_ok=True)


def pytest_terminal_summary(terminalreporter):
    for nodeid, done in getattr(terminalreporter.config, "_jppo_reruns", {}).items():
        verdict = "passed" if done.returncode == 0 else f"FAILED (exit {done.returncode})"
        terminalreporter.section(f"a worker that crashed: {nodeid}, rerun alone in a fresh process: {verdict}")
        terminalreporter.write((done.stdout + done.stderr)[-3000:] + "\n")
    for log in sorted(HANGS.glob("worker-*.txt")):
        if hung(log):
            terminalreporter.section(f"a test that hung ({log.name})")
            terminalreporter.write(log.read_text())


def hung(log: pathlib.Path) -> bool:
    """Whether the watchdog wrote stacks in ``log`` (a test's header alone: its worker crashed, or was killed)."""
    text = log.read_text()
    return "Thread 0x" in text or "Timeout (" in text


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput"):  # the session's own process, after its workers have ended
        for log in HANGS.glob("worker-*.txt"):
            if not hung(log):
                log.unlink()
        try:
            HANGS.rmdir()  # only when empty: a hung test's stacks stay for whoever reads them
        except OSError:
            pass


# A worker that dies in native code. XLA:CPU has segfaulted in long-lived workers late in a run, never in a fresh
# process: serializing an executable for the cache (a C++ exception the unwinder faulted on: CI, three runs in
# tests/test_moe_update.py, once hung under tvm_ffi's SIGSEGV handler) and compiling one with the workers' cache off
# (tests/test_tracking.py, "Fatal Python error: Segmentation fault" in backend_compile_and_load). xdist restarts the
# worker (pyproject's --max-worker-restart), the files it had left run on, and the crashed test is reported failed;
# here, at the end, each crashed test runs again alone in a fresh process. The run passes only if every failure was
# such a crash and every rerun passed; the summary names them under "a worker that crashed", with the crash's output.
CRASHED = "crashed while running"
CRASHED_THEN_PASSED = "crashed, then passed alone"


def crashed_tests(stats: dict) -> tuple[list[str], bool]:
    """The node ids of the tests whose worker crashed, and whether every failure or error was one of those."""
    failures = stats.get("failed", []) + stats.get("error", [])
    crashed = [report.nodeid for report in failures if CRASHED in str(report.longrepr)]
    return crashed, len(crashed) == len(failures)


def rerun_alone(nodeid: str, rootdir: pathlib.Path) -> subprocess.CompletedProcess:
    """``nodeid`` (relative to the session's ``rootdir``) run again in a fresh process (pytest-timeout and the
    watchdog still bound it)."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", nodeid]
    try:
        return subprocess.run(command, cwd=rootdir, capture_output=True,
                              text=True, timeout=1800)
    except subprocess.TimeoutExpired as error:
        return subprocess.CompletedProcess(command, 124, str(error.stdout or ""), "rerun timed out after 1800 s")


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if hasattr(session.config, "workerinput") or reporter is None or exitstatus != pytest.ExitCode.TESTS_FAILED:
        return
    crashed, only_crashes = crashed_tests(reporter.stats)
    if not crashed:
        return
    reruns = {nodeid: rerun_alone(nodeid, session.config.rootpath) for nodeid in crashed}
    session.config._jppo_reruns = reruns
    if only_crashes and all(done.returncode == 0 for done in reruns.values()):
        session.exitstatus = pytest.ExitCode.OK
        # the summary line counts them apart: not failed, and not quietly passed either
        reporter.stats[CRASHED_THEN_PASSED] = reporter.stats.pop("failed")
