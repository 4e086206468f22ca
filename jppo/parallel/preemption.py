"""Preemption: a signal asks a run to stop, and every process stops at the same step boundary, checkpointed.

A spot TPU VM or a preemptible GPU node gets SIGTERM and a short grace period before it is killed; SLURM sends the
signal of ``sbatch --signal`` (SIGUSR1 in ``tpu_scripts/gpu_slurm.sbatch``) ahead of a job's time limit. On either
(:data:`SIGNALS`) a process only notes the request (:class:`StopRequest`). After each training step's hooks, every
process asks whether *any* process was asked to stop (:meth:`StopRequest.agreed`); when one was, all of them save
that step (atomic, as every checkpoint; an asynchronous save waited for), meet once more so that none leaves before
the checkpoint is committed, and leave the run with :class:`Preempted`; ``python -m jppo.train`` then exits with
:data:`PREEMPTED_EXIT`, which the launch scripts read as "restart me" (``trainer.resume: auto`` continues from that
step, bit for bit: every draw of a step is a function of the seed and the step, and the off-policy weight queue is
part of the checkpoint).

The agreement is one all-gather of one integer per process at every step boundary (milliseconds, next to a step of
seconds): the processes gather the same values at the same step, so they stop at the same step whatever moment
each received its signal (on some hosts only, or at different times). JAX's preemption sync point
(``multihost_utils.reached_preemption_sync_point``) is not used: it exists only with a distributed client (not for
one process), it hears SIGTERM alone through its own handler (not SLURM's ``--signal``), and it would make the
single- and multi-process paths differ.

The grace period a run needs is the rest of the step in progress plus one checkpoint write (docs/running.md).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Callable, Optional

import jax
import numpy as np
from jax.experimental import multihost_utils

from jppo.parallel.hostlocal import max_over_processes

log = logging.getLogger("jppo.parallel.preemption")

# sysexits' EX_TEMPFAIL ("a temporary failure; try again later"): not 0 (done), 1 (a bug) or 2 (a bad input)
PREEMPTED_EXIT = 75
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # a preemption notice; SLURM's --signal (gpu_slurm.sbatch: USR1)


class Preempted(Exception):
    """The run stopped on a signal after step ``step``, whose checkpoint is committed ``seconds`` after this
    process received the signal (None: another process received it)."""

    def __init__(self, step: int, signal_name: Optional[str], seconds: Optional[float]):
        cause = signal_name or "another process's signal"
        within = "" if seconds is None else f" {seconds:.1f} s after the signal"
        super().__init__(f"stopped on {cause} after step {step}, checkpointed{within}")
        self.step, self.signal_name, self.seconds = step, signal_name, seconds


class StopRequest:
    """While entered: :data:`SIGNALS` set a flag instead of ending the process (handlers installed by the main
    thread; elsewhere nothing changes). Leaving restores the previous handlers."""

    def __init__(self, signals: tuple[int, ...] = SIGNALS):
        self.signals, self.received, self.received_at = signals, None, None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for number in self.signals:
                self._previous[number] = signal.signal(number, self._note)
        return self

    def __exit__(self, *exc_info) -> None:
        for number, handler in self._previous.items():
            # a handler installed outside Python (None here) cannot be reinstalled: the default stands in
            signal.signal(number, signal.SIG_DFL if handler is None else handler)
        self._previous.clear()

    def _note(self, number: int, frame) -> None:
        if self.received is None:
            self.received, self.received_at = signal.Signals(number).name, time.monotonic()
            log.warning("%s received: the run stops after the current step, with a checkpoint", self.received)

    def agreed(self) -> bool:
        """Whether any process of the run was asked to stop (a collective: every process calls it at the same
        step boundary)."""
        asked = np.int32(self.received is not None)
        return bool(asked if jax.process_count() == 1 else max_over_processes(asked))

    def at_boundary(self, step: int, total: int, save: Callable[[], None], wait: Callable[[], None]) -> None:
        """After step ``step``'s hooks: when a process was asked to stop (and the run is not done anyway), ``save``
        the step, ``wait`` for the save to commit, meet the other processes and raise :class:`Preempted`."""
        if step >= total or not self.agreed():
            return
        save()
        wait()
        if jax.process_count() > 1:  # the commit is the primary's: no process leaves before it
            multihost_utils.sync_global_devices("jppo: preemption checkpoint committed")
        seconds = None if self.received_at is None else time.monotonic() - self.received_at
        raise Preempted(step, self.received, seconds)
