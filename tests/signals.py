"""A signal sent to the process at a chosen point of a chosen training step (the preemption tests of
tests/test_whole_run.py, in process, and tests/test_distributed.py, in one process of a multi-process run)."""

from __future__ import annotations

import os

# Where a signal may land in a step: the collection, the rollout (with off-policy steps: of the next step, on its
# thread beside the update on one device, in turn on a mesh), the update, the wait for the rollout, the logging and
# the periodic save (when the step is one).
SIGNAL_POINTS = ("collect", "rollout", "update", "wait", "log", "save")


def signal_at(monkeypatch, step: int, point: str, number: int) -> None:
    """Sends ``number`` to this process once, when training step ``step`` enters ``point`` (``monkeypatch``: a
    pytest ``MonkeyPatch``, undone with it)."""
    import jppo.run.lifecycle as lifecycle
    import jppo.run.loop as loop
    import jppo.run.offpolicy as offpolicy
    from jppo.runlog import RunLogger

    owner, name = {"collect": (loop, "collect"), "rollout": (offpolicy, "generate"), "update": (loop, "learn"),
                   "wait": (offpolicy.OffPolicy, "finish"), "log": (RunLogger, "log"),
                   "save": (lifecycle, "save")}[point]
    current, fired, train_step, original = [0], [], loop.train_step, getattr(owner, name)

    def counted(collector, learner, state, *args):
        current[0] = int(state.step) + 1
        return train_step(collector, learner, state, *args)

    def signalled(*args, **kwargs):
        if current[0] == step and not fired:
            fired.append(point)
            os.kill(os.getpid(), number)
        return original(*args, **kwargs)

    monkeypatch.setattr(loop, "train_step", counted)
    monkeypatch.setattr(owner, name, signalled)
