"""Test session set-up: 8 simulated CPU devices and a persistent compile cache, before any JAX operation; the
longest test files first."""

import faulthandler
import os
import pathlib
import subprocess
import sys
import tempfile

import pytest

# The suite runs on the CPU. libtpu (the test extra brings it, to compile for TPU targets with compile-only devices)
# would otherwise try to open a TPU in every process, ours and the subprocesses', and print its warnings.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Loading libtpu for compile-only TPU devices takes a machine-wide lock file (/tmp/libtpu_lockfile) for the life of
# the process, meant to keep two processes off one TPU: the second xdist worker (or any other process) to compile for
# a TPU target would fail with "Internal error when accessing libtpu multi-process lockfile". There is no TPU here.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# The runs the tests start as subprocesses share one compilation cache folder (JAX_COMPILATION_CACHE_DIR, exported
# below): a resumed run, or the second process of a two-process run, reads what the first compiled. JAX writes an entry
# in place and, unless the cache has a size bound, reads it without a lock: a program compiled by two processes at
# once can be read half-written, and XLA aborts deserializing it ("Fatal Python error: Aborted" in
# compilation_cache.get_executable_and_time, seen here). A bound turns on JAX's file lock around every read and
# write; this one (1 TiB) never evicts.
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(2**40))
_CACHE = pathlib.Path(
    os.environ.get("JAX_COMPILATION_CACHE_DIR", pathlib.Path(__file__).resolve().parents[1] / ".jax_cache")
)
os.environ["JAX_COMPILATION_CACHE_DIR"] = str(_CACHE)

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
# XLA's CPU backend at its lowest optimization level: the suite's programs compile about a third faster (most of its
# time is compilation) and every test checks numbers, never speed. Subprocesses inherit it; the multi-process runs of
# tests/test_distributed.py drop it, so the suite also runs the optimized programs a user's run compiles.
# JAX_DISABLE_MOST_OPTIMIZATIONS=0 runs the whole suite optimized.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
jax.config.update("jax_disable_most_optimizations", os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] not in ("0", "false"))
# The workers share the folder too (JPPO_TEST_WORKER_CACHE=0: they leave it alone). A cold full run here took 1767 s
# with it and 1800 s without; a warm rerun is much faster with it.
jax.config.update("jax_compilation_cache_dir", str(_CACHE))
jax.config.update("jax_enable_compilation_cache", os.environ.get("JPPO_TEST_WORKER_CACHE", "1") == "1")
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

# The files that take longest on the 2-core CI machine (minutes each, from its --durations), longest first. With
# ``--dist loadfile --no-loadscope-reorder`` the workers take files in collection order, so these start first and
# the last files to start are the short ones: the two workers end close together. xdist's own order (most tests
# first) started the audit and the two-process runs, few tests but minutes long, near the end.
LONGEST_FIRST = (
    "test_engine_update.py", "test_audit.py", "test_train.py", "test_lora.py", "test_whole_run.py",
    "test_distributed.py", "test_bench.py", "test_vllm_servers.py", "test_rollout.py",
    "test_config_fuzz.py", "test_engine_assemble.py", "test_losses_variants.py", "test_rollout_correction.py",
    "test_sequence_parallel.py", "test_old_log_prob.py",
)


# ... and the files that start vLLM in the worker's own process, last: its engine loads xgrammar's tvm_ffi, which
# installs a SIGSEGV handler that prints a backtrace with the C++ unwinder. A later C++ exception in that worker
# (XLA serializing an executable for the compilation cache) once faulted inside the unwinder, and the handler then
# waited forever on the unwinder's own lock, holding the GIL: tests/test_moe_update.py stalled after 1545 of 1552
# tests (py-spy: __cxa_throw -> _Unwind_Find_FDE -> SIGSEGV -> TVMFFIBacktrace -> pthread_mutex_lock), as CI did.
# Run last, nothing of the suite follows vLLM in its worker.
LAST = ("test_vllm_engine.py",)


def file_rank(name: str) -> int:
    """A test file's place in the run: its index in LONGEST_FIRST, then every other file, then LAST."""
    if name in LAST:
        return len(LONGEST_FIRST) + 1
    return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(items):
    # a stable sort: each file's tests, and the files outside LONGEST_FIRST, keep their collected order
    items.sort(key=lambda item: file_rank(item.path.name))


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
    with open(log, "w") as out:
        out.write(f"{item.nodeid} ran past {limit:g} s:\n")
        out.flush()
        faulthandler.dump_traceback_later(limit, exit=True, file=out)
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()
    log.unlink()


def pytest_terminal_summary(terminalreporter):
    for nodeid, done in getattr(terminalreporter.config, "_jppo_reruns", {}).items():
        verdict = "passed" if done.returncode == 0 else f"FAILED (exit {done.returncode})"
        terminalreporter.section(f"a worker that crashed: {nodeid}, rerun alone in a fresh process: {verdict}")
        terminalreporter.write((done.stdout + done.stderr)[-3000:] + "\n")
    for log in sorted(HANGS.glob("worker-*.txt")):
        text = log.read_text()
        if "Thread 0x" in text or "Timeout (" in text:  # the watchdog wrote (a test's header alone: nothing)
            terminalreporter.section(f"a test that hung ({log.name})")
            terminalreporter.write(text)


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput"):  # the session's own process, after its workers have ended
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


def crashed_tests(stats: dict) -> tuple[list[str], bool]:
    """The node ids of the tests whose worker crashed, and whether every failure or error was one of those."""
    failures = stats.get("failed", []) + stats.get("error", [])
    crashed = [report.nodeid for report in failures if CRASHED in str(report.longrepr)]
    return crashed, len(crashed) == len(failures)


def rerun_alone(nodeid: str) -> subprocess.CompletedProcess:
    """``nodeid`` run again in a fresh process (pytest-timeout and the watchdog still bound it)."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", nodeid]
    try:
        return subprocess.run(command, cwd=pathlib.Path(__file__).resolve().parents[1], capture_output=True,
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
    reruns = {nodeid: rerun_alone(nodeid) for nodeid in crashed}
    session.config._jppo_reruns = reruns
    if only_crashes and all(done.returncode == 0 for done in reruns.values()):
        session.exitstatus = pytest.ExitCode.OK
