"""Test session set-up: 8 simulated CPU devices and a persistent compile cache, before any JAX operation; the
longest test files first; a hung test or a crashed worker ends the run all the same (tests/worker_crashes.py)."""

import os
import pathlib

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

# The files that take longest (seconds of test time each in a cold full run here, 2 cores: whole_run 380-441, audit
# 280, distributed 280, engine_update 251-315, train 189-209, lora 168, docs 75-103, bench 85-97, vllm_servers 84,
# learning 65-77, rollout 64, device_check 58, config_fuzz 58, ...), longest first. With ``--dist loadfile
# --no-loadscope-reorder`` the workers take files in collection order, so these start first and the last files to
# start are the short ones: the two workers end close together. xdist's own order (most tests first) started the
# audit and the two-process runs, few tests but minutes long, near the end.
LONGEST_FIRST = (
    # first of all, not by its time (102 s): six of the eight native worker crashes so far were XLA:CPU segfaulting
    # while compiling (or serializing for the cache) one of this file's float64 programs, always in a worker that
    # had run for many minutes, never in a process of its own; taken first, its worker has run nothing yet
    "test_moe_update.py",
    "test_whole_run.py", "test_audit.py", "test_distributed.py", "test_engine_update.py", "test_train.py",
    "test_lora.py", "test_docs.py", "test_bench.py", "test_vllm_servers.py", "test_learning.py", "test_rollout.py",
    "test_device_check.py", "test_config_fuzz.py", "test_rollout_correction.py", "test_sequence_parallel.py",
    "test_engine_assemble.py", "test_old_log_prob.py",
)


# ... and the file that starts vLLM in the worker's own process, last, so that nothing of the suite follows it in its
# worker: its engine loads xgrammar's tvm_ffi, which installs a SIGSEGV handler that prints a backtrace with the C++
# unwinder; a later fault in that worker then waited forever on the unwinder's own lock, holding the GIL (py-spy:
# __cxa_throw -> _Unwind_Find_FDE -> SIGSEGV -> TVMFFIBacktrace -> pthread_mutex_lock).
LAST = ("test_vllm_engine.py",)


def file_rank(name: str) -> int:
    """A test file's place in the run: its index in LONGEST_FIRST, then every other file, then LAST in order."""
    if name in LAST:
        return len(LONGEST_FIRST) + 1 + LAST.index(name)
    return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(items):
    # a stable sort: each file's tests, and the files outside LONGEST_FIRST, keep their collected order
    items.sort(key=lambda item: file_rank(item.path.name))


# What the run does about a test that hangs or a worker that crashes: tests/worker_crashes.py.
from worker_crashes import (  # noqa: E402,F401  (pytest reads the hooks from this module's names)
    pytest_runtest_protocol,
    pytest_sessionfinish,
    pytest_terminal_summary,
    pytest_unconfigure,
    pytest_xdist_make_scheduler,
)
