"""Reward calls that cannot take the run down: bounded in time and isolated in processes of their own.

A reward is user code (``reward.function``, verl's ``compute_score``, a TRL reward function) or a rule run on what
the model wrote; one row whose scorer hangs, raises, calls ``os._exit`` or leaks memory must not stop a run. With
``reward.workers = W >= 1`` the rows of a batch are scored one per call by ``W`` processes of their own (started with
``python -m jppo.rewards.workers``: a fresh interpreter that imports the reward and nothing of the trainer, no JAX),
each of which builds the same reward function the trainer would (:func:`jppo.rewards.reward_fn.build_reward_fn`).
A call fails when it

- raises (the worker lives on; after a ``MemoryError`` it is replaced, its memory being spent),
- takes longer than ``reward.timeout_s`` (the worker is killed and replaced), or
- kills its worker (``os._exit``, a signal, the address-space limit ``reward.worker_memory_mb``; it is replaced).

A failed call scores what ``reward.on_error`` says: ``raise`` stops the run with one line naming the row, the
function and the error; ``zero`` scores the row 0 and counts it (``reward/errors``, ``reward/timeouts``). A row that
does not fail gets exactly the in-process reward: the worker calls the same function on the same row, and a float32
crosses the pipe as it is. With ``reward.workers = 0`` the reward runs in the trainer's process; ``on_error: zero``
then scores the rows again one by one when a batch fails, and zeroes the ones that raise (no time limit: a call in
the trainer's process cannot be stopped).

Rows are scored one per call: a ``reward.function`` that scores a batch more cheaply than its rows one by one (a
reward model behind a server, say) is better off in the trainer's process.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import time
import weakref
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Optional, Sequence

import numpy as np

from jppo.core.errors import RewardFunctionError, error_line
from jppo.core.inputs import RewardConfig

log = logging.getLogger("jppo.rewards.workers")

TaskSpec = Optional[tuple[str, dict]]  # (data.task, data.task_options); None: no task (data.task: files)
START_TIMEOUT_S = 120.0  # a worker that has not built its reward by then is an error (an import that hangs)
START_ATTEMPTS = 3  # a worker that dies before it has built its reward is started again, this many times at most


def describe(cfg: RewardConfig) -> str:
    """How errors name the reward: ``reward.function=<spec>`` or ``reward.kind=<kind>``."""
    return f"reward.function={cfg.function}" if cfg.function is not None else f"reward.kind={cfg.kind}"


def build_in_worker(cfg: RewardConfig, task: TaskSpec) -> Callable:
    """The reward function a worker calls: the trainer's own, built from the same config and task."""
    from jppo.data.tasks import get_task  # noqa: PLC0415 (in the worker only)
    from jppo.rewards.reward_fn import build_reward_fn  # noqa: PLC0415 (the package imports this module)

    return build_reward_fn(cfg, None if task is None else get_task(task[0], task[1]))


def cause_line(error: Exception) -> str:
    """What a one-row call raised, on one line: the user's own error rather than the wrapper that names sample 0
    of the one-row call (:class:`jppo.rewards.plugin.RewardPlugin`); a check of what it returned as it is."""
    cause = error.__cause__ if isinstance(error, RewardFunctionError) and error.__cause__ is not None else error
    return error_line(cause) if cause is not error else " ".join(str(error).split())


@dataclasses.dataclass
class Tally:
    """Failed calls since the last :meth:`Guarded.drain`."""

    errors: int = 0
    timeouts: int = 0


class Guarded:
    """``reward_fn`` (built in the trainer's process, which checks that the reward loads) with ``reward.on_error``
    applied: called there (``reward.workers = 0``) or in a pool of workers that build it again. ``drain()``
    gives the failures counted since it was last called; ``close()`` stops the workers (also done when the object
    is collected and at exit)."""

    def __init__(self, reward_fn: Callable, cfg: RewardConfig, task: TaskSpec):
        self.reward_fn, self.cfg, self.name, self.tally = reward_fn, cfg, describe(cfg), Tally()
        self.pool = Pool(cfg, task) if cfg.workers > 0 else None
        self._finalizer = weakref.finalize(self, Pool.close, self.pool) if self.pool is not None else None

    def __call__(self, responses: list[str], examples: list, finished: Sequence[bool]) -> np.ndarray:
        if self.pool is not None:
            return self.pool.score(responses, examples, finished, self._failed)
        try:
            return self.reward_fn(responses, examples, finished)
        except RewardFunctionError:
            if self.cfg.on_error == "raise":
                raise
        values = np.zeros(len(responses), np.float32)
        for index, row in enumerate(zip(responses, examples, finished)):
            try:
                values[index] = self.reward_fn(*([part] for part in row))[0]
            except RewardFunctionError as error:
                self._failed(index, responses[index], cause_line(error), timeout=False)
        return values

    def _failed(self, index: int, response: str, what: str, timeout: bool) -> None:
        if self.cfg.on_error == "raise":
            raise RewardFunctionError(f"{self.name} failed on sample {index} (response {response[:80]!r}): {what}")
        if timeout:
            self.tally.timeouts += 1
        else:
            self.tally.errors += 1
        log.warning("%s failed on sample %d, scored 0 (reward.on_error=zero): %s", self.name, index, what)

    def drain(self) -> Tally:
        tally, self.tally = self.tally, Tally()
        return tally

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()


class Worker:
    """One scoring process and the two pipes to it; ``ready`` once it has built its reward function."""

    def __init__(self, cfg: RewardConfig, task: TaskSpec, attempt: int = 1):
        self.attempt = attempt  # how many times in a row this worker's start was tried
        to_child, from_parent = os.pipe()
        to_parent, from_child = os.pipe()
        env = dict(os.environ, JAX_PLATFORMS="cpu", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "jppo.rewards.workers", str(to_child), str(from_child)],
            # a session of its own: a signal to the trainer's process group (Ctrl-C, a launcher's SIGTERM) is the
            # trainer's to act on; the worker also ignores those signals once it runs (a job-wide kill reaches it)
            pass_fds=(to_child, from_child), env=env, stdin=subprocess.DEVNULL, start_new_session=True,
        )
        os.close(to_child)
        os.close(from_child)
        self.send, self.receive = Connection(from_parent, readable=False), Connection(to_parent, writable=False)
        self.send.send((cfg, task))
        self.ready, self.started = False, time.monotonic()
        self.job: Optional[tuple[int, float]] = None  # (row index, deadline) of the call in flight

    def stop(self, kill: bool = False) -> None:
        try:
            if not kill:
                self.send.send(None)
                self.process.wait(timeout=5)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            pass
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        for connection in (self.send, self.receive):
            connection.close()


class Pool:
    """``reward.workers`` scoring processes; a worker that fails a call by dying, timing out or running out of
    memory is replaced before its next row."""

    def __init__(self, cfg: RewardConfig, task: TaskSpec):
        self.cfg, self.task = cfg, task
        self.workers = [Worker(cfg, task) for _ in range(cfg.workers)]

    def score(self, responses: list[str], examples: list, finished: Sequence[bool], failed: Callable) -> np.ndarray:
        """Each row's reward, scored by the next free worker; ``failed(index, response, what, timeout)`` for each
        row whose call failed (it raises under ``reward.on_error: raise``; the row then scores 0)."""
        values = np.zeros(len(responses), np.float32)
        pending = list(range(len(responses)))[::-1]
        timeout = self.cfg.timeout_s if self.cfg.timeout_s is not None else float("inf")
        while pending or any(w.job is not None for w in self.workers):
            now = time.monotonic()
            for worker in self.workers:
                if worker.ready and worker.job is None and pending:
                    index = pending.pop()
                    worker.send.send((responses[index], examples[index], bool(finished[index])))
                    worker.job = (index, now + timeout)
            deadlines = [w.job[1] for w in self.workers if w.job is not None]
            deadlines += [w.started + START_TIMEOUT_S for w in self.workers if not w.ready]
            first = min(deadlines, default=float("inf"))
            wait([w.receive for w in self.workers], timeout=None if first == float("inf") else max(0.0, first - now))
            for slot, worker in enumerate(self.workers):
                self.workers[slot] = self._collect(worker, responses, values, failed)
        return values

    def _collect(self, worker: Worker, responses: list[str], values: np.ndarray, failed: Callable) -> Worker:
        """``worker`` after reading what it sent, or its replacement when it died, timed out or spent its memory."""
        now = time.monotonic()
        if worker.receive.poll():
            try:
                message = worker.receive.recv()
            except (EOFError, OSError):
                message = ("died", None)
            if message[0] == "ready":
                worker.ready = True
                return worker
            if message[0] == "fatal":
                worker.stop(kill=True)
                raise RewardFunctionError(f"{describe(self.cfg)} could not be built in a reward worker: {message[1]}")
            if message[0] == "died" and not worker.ready:  # a signal in its start-up, or a reward that cannot load
                code = worker.process.wait()
                worker.stop(kill=True)
                if worker.attempt < START_ATTEMPTS:
                    return Worker(self.cfg, self.task, worker.attempt + 1)
                raise RewardFunctionError(
                    f"a reward worker exited with status {code} before building {describe(self.cfg)}, "
                    f"{START_ATTEMPTS} times in a row"
                )
            index, worker.job = worker.job[0], None
            if message[0] == "ok":
                values[index] = message[1]
                return worker
            if message[0] == "error":
                failed(index, responses[index], message[1], timeout=False)
                return worker if not message[1].startswith("MemoryError") else self._replaced(worker)
            code = worker.process.wait()
            failed(index, responses[index], f"its worker died (exit status {code})", timeout=False)
            return self._replaced(worker)
        if not worker.ready and now > worker.started + START_TIMEOUT_S:
            worker.stop(kill=True)
            raise RewardFunctionError(f"a reward worker did not build {describe(self.cfg)} in {START_TIMEOUT_S:.0f} s")
        if worker.job is not None and now >= worker.job[1]:
            index = worker.job[0]
            replacement = self._replaced(worker)
            failed(index, responses[index], f"timed out after reward.timeout_s={self.cfg.timeout_s} s", timeout=True)
            return replacement
        return worker

    def _replaced(self, worker: Worker) -> Worker:
        worker.stop(kill=True)
        return Worker(self.cfg, self.task)

    @staticmethod
    def close(pool: Optional["Pool"]) -> None:
        for worker in pool.workers if pool is not None else ():
            worker.stop()


def _serve(receive: Connection, send: Connection) -> None:
    """A worker's life: build the reward from the config the trainer sends, then score one row per message until
    ``None`` or the pipe closes."""
    import signal  # noqa: PLC0415 (the worker's own)

    # a preemption notice or Ctrl-C reaches the whole process group: the trainer decides what it means (it may be
    # scoring the step it will checkpoint); a worker ends when the trainer closes its pipe, or kills it
    for number in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(number, signal.SIG_IGN)
    cfg, task = receive.recv()
    if cfg.worker_memory_mb is not None:
        import resource  # noqa: PLC0415 (POSIX only)

        limit = cfg.worker_memory_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        reward_fn = build_in_worker(cfg, task)
    except Exception as error:  # noqa: BLE001 (reported to the trainer, which stops the run in one line)
        send.send(("fatal", error_line(error)))
        return
    send.send(("ready", None))
    while True:
        try:
            job: Any = receive.recv()
        except EOFError:
            return
        if job is None:
            return
        response, example, done = job
        try:
            send.send(("ok", float(np.float32(reward_fn([response], [example], [done])[0]))))
        except Exception as error:  # noqa: BLE001 (the row's failure, scored by reward.on_error)
            send.send(("error", cause_line(error)))


if __name__ == "__main__":
    try:
        _serve(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False))
    except (BrokenPipeError, EOFError):  # the trainer stopped listening (it closed the pool, or it exited)
        pass
