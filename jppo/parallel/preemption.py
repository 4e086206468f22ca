"""Preemption: a signal asks a run to stop, and every process stops at the same step boundary, checkpointed.

A spot TPU VM or a preemptible GPU node gets SIGTERM and a short grace period before it is killed; SLURM sends the
signal of ``sbatch --signal`` (SIGUSR1 in ``tpu_scripts/gpu_slurm.sbatch``) ahead of a job's time limit. On either
(:data:`SIGNALS`) a process only notes the request (:class:`StopRequest`). After each training step, before its hooks
and again after them, every process asks whether *any* process was asked to stop (:meth:`StopRequest.agreed`); when
one was, all of them skip the step's validation (asked before the hooks: a held-out evaluation could outlast the
grace period), save that step (atomic, as every checkpoint; an asynchronous save waited for), meet once more so that
none leaves before the checkpoint is committed, and leave the run with :class:`Preempted`; ``python -m jppo.train``
then exits with :data:`PREEMPTED_EXIT`, which the launch scripts read as "restart me" (``trainer.resume: auto``
continues from that step, bit for bit: every draw of a step is a function of the seed and the step, and the
off-policy weight queue is part of the checkpoint).

Outside the training steps (start-up, input loading, the final export) the commands' request stops at once
(``immediate``): there is nothing new to save, and the last complete checkpoint is where the run resumes.

The agreement is two all-gathers of one integer per process at every step boundary (milliseconds, next to a step of
seconds): the processes gather the same values at the same step, so they stop at the same step whatever moment
each received its signal (on some hosts only, or at different times). JAX's preemption sync point
(``multihost_utils.reached_preemption_sync_point``) is not used: it exists only with a distributed client (not for
one process), it hears SIGTERM alone through its own handler (not SLURM's ``--signal``), and it would make the
single- and multi-process paths differ.

The grace period a run needs is the rest of the step in progress plus one checkpoint write (docs/running.md).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from typing import Callable, Iterator, Optional

import jax
import numpy as np
from jax.experimental import multihost_utils

from jppo.parallel.hostlocal import max_over_processes

log = logging.getLogger("jppo.parallel.preemption")

# sysexits' EX_TEMPFAIL ("a temporary failure; try again later"): not 0 (done), 1 (a bug) or 2 (a bad input)
PREEMPTED_EXIT = 75
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # a preemption notice; SLURM's --signal (gpu_slurm.sbatch: USR1)


class Preempted(BaseException):
    """The run stopped on a signal: after step ``step``, whose checkpoint is committed ``seconds`` after this
    process received the signal (None: another process received it); or, with ``step`` None, outside the training
    steps (start-up, input loading, the final export), where there is nothing new to save and the last complete
    checkpoint is where the same command resumes. Not an ``Exception``, as ``KeyboardInterrupt`` is not: raised
    where a signal lands, it must pass the ``except Exception`` of whatever code was running (a plug-in's loader)."""

    def __init__(self, step: Optional[int], signal_name: Optional[str], seconds: Optional[float]):
        cause = signal_name or "another process's signal"
        if step is None:
            message = f"stopped on {cause} outside the training steps (nothing new to checkpoint)"
        else:
            within = "" if seconds is None else f" {seconds:.1f} s after the signal"
            message = f"stopped on {cause} after step {step}, checkpointed{within}"
        super().__init__(message)
        self.step, self.signal_name, self.seconds = step, signal_name, seconds


class StopRequest:
    """While entered: :data:`SIGNALS` set a flag instead of ending the process (handlers installed by the main
    thread; elsewhere nothing changes). Leaving restores the previous handlers.

    ``immediate``: a signal also raises :class:`Preempted` at once, where the main thread is (the commands enter
    one at the top of ``main()``, so that a signal during start-up, input loading or the final export ends in the
    status a launch script re-queues); inside :meth:`deferred` (the training steps) it is only noted, and the run
    stops at the next step boundary, checkpointed. :attr:`active` is the one entered, which a run started inside
    it reuses."""

    active: Optional["StopRequest"] = None

    def __init__(self, signals: tuple[int, ...] = SIGNALS, immediate: bool = False):
        self.signals, self.received, self.received_at, self.immediate = signals, None, None, immediate
        self._previous: dict[int, object] = {}
        self._outer: Optional[StopRequest] = None

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for number in self.signals:
                self._previous[number] = signal.signal(number, self._note)
        self._outer, StopRequest.active = StopRequest.active, self
        return self

    def __exit__(self, *exc_info) -> None:
        StopRequest.active = self._outer
        for number, handler in self._previous.items():
            # a handler installed outside Python (None here) cannot be reinstalled: the default stands in
            signal.signal(number, signal.SIG_DFL if handler is None else handler)
        self._previous.clear()

    def reinstall(self) -> None:
        """Takes the signals back after something installed handlers of its own over this request's (JAX's
        distributed client installs its preemption notifier's, in C++, when it starts)."""
        if self._previous:
            for number in self.signals:
                signal.signal(number, self._note)

    def _note(self, number: int, frame) -> None:
        if self.received is None:
            self.received, self.received_at = signal.Signals(number).name, time.monotonic()
            if not self.immediate:
                log.warning("%s received: the run stops after the current step, with a checkpoint", self.received)
        if self.immediate:
            raise Preempted(None, self.received, None)

    @contextlib.contextmanager
    def deferred(self) -> Iterator["StopRequest"]:
        """Signals only noted inside: the training steps, which stop at a step boundary (:meth:`agreed`,
        :meth:`leave`). A signal noted before is a stop now; one noted inside and not acted on (during the last
        step) is one when leaving, before what follows the steps (the export) starts."""
        if self.received is not None and self.immediate:
            raise Preempted(None, self.received, None)
        before, self.immediate = self.immediate, False
        try:
            yield self
        finally:
            self.immediate = before
        if before and self.received is not None:
            raise Preempted(None, self.received, None)

    def agreed(self) -> bool:
        """Whether any process of the run was asked to stop (a collective: every process calls it at the same
        step boundary)."""
        asked = np.int32(self.received is not None)
        return bool(asked if jax.process_count() == 1 else max_over_processes(asked))

    def leave(self, step: int, save: Callable[[], None], wait: Callable[[], None]) -> None:
        """After :meth:`agreed` said stop at step ``step``: ``save`` the step, ``wait`` for the save to commit, meet
        the other processes and raise :class:`Preempted`."""
        save()
        wait()
        if jax.process_count() > 1:  # the commit is the primary's: no process leaves before it
            multihost_utils.sync_global_devices("jppo: preemption checkpoint committed")
        seconds = None if self.received_at is None else time.monotonic() - self.received_at
        raise Preempted(step, self.received, seconds)
