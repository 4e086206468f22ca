"""Off-policy steps (``trainer.off_policy_steps: k``): the next step's rollout is generated while this step trains.

**The schedule** is fixed by (seed, step, k), never by timing. Training step ``t`` (1-based) trains on a batch
sampled with the policy's weights after

    u(t) = max(0, t - 1 - k)

updates (:func:`behaviour_updates`), so the batch is ``s(t) = (t - 1) - u(t) = min(t - 1, k)`` updates old when it
trains (:func:`staleness`, logged as ``async/staleness``). k = 0 is the on-policy loop: ``u(t) = t - 1``, the
weights being trained. For k >= 1, ``u(t + 1) = max(0, t - k) <= t - 1``: step ``t + 1``'s batch needs only weights
that exist before step ``t``'s update, so it can be generated while that update runs. Its other inputs are the
step's key ``fold_in(seed key, t + 1)`` and the data position after batch ``t``, so the run's numbers do not depend
on whether, or how fast, the generation ran beside the update.

**The queue.** Before step ``t`` (``t - 1`` updates done) the batches ``t .. t + k - 1`` need the weights after
``u(t) .. u(t + k - 1)`` updates, which the updates overwrite: ``RunState.behind`` holds them, oldest first (copies
of the trained parameters; LoRA's frozen base weights are shared). Batch ``t + k`` needs ``u(t + k) = t - 1``
updates: the current weights. Step ``t``'s update then makes the queue drop its head and take the weights from
before that update (:func:`pushed`). At the start all k entries are the initial weights. The queue is part of the
checkpoint, so a resumed run regenerates a pending batch from the very weights the interrupted run used.

**The overlap** (:class:`OffPolicy`): on a one-device mesh, with the rollout on devices of its own
(``rollout.devices``, :mod:`jppo.run.rollout_mesh`, in one process or several), or with an external engine
(``rollout.engine: vllm``, in one process), without a reward model (which scores on the training mesh), the next
batch is sampled and scored on a background thread during the update. On devices of its own its weights move to
them first, on the main thread before the update is dispatched (:func:`move`), then the sampler runs there while
the update runs on the training mesh: a decoding loop runs on each device's own rows and communicates nothing
(:func:`~jppo.parallel.mesh.on_each_device`), so the rollout's program has no collective to interleave with the
update's, across processes too. On a multi-device mesh shared by both, the JAX sampler runs the same
devices as the update, whose XLA programs (with their collectives) would serialize on them or interleave their
collectives, so the next batch is generated in turn, with the same results.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from jppo.run.collect import Collector, sample_and_score
from jppo.run.state import RunState
from jppo.runlog.timing import PhaseTimer


def behaviour_updates(step: int, k: int) -> int:
    """How many updates the weights that sample training step ``step``'s batch (1-based) have had."""
    return max(0, step - 1 - k)


def staleness(step: int, k: int) -> int:
    """Updates between the weights that sampled step ``step``'s batch and the weights it trains (``min(step-1, k)``)."""
    return step - 1 - behaviour_updates(step, k)


def copied(params: nnx.State) -> nnx.State:
    """New buffers holding ``params``: the update donates the parameters it is given, so a copy kept for later
    sampling must not share them."""
    return jax.tree.map(jnp.copy, params)


def initial_behind(params: nnx.State, k: int) -> Optional[tuple]:
    """The queue before step 1: k times the initial weights (one copy, shared), or None at k = 0 (nothing held,
    so a checkpoint is what it has always been)."""
    return (copied(params),) * k if k else None


def pushed(behind: tuple, params: nnx.State) -> tuple:
    """The queue one update on: its head (the weights of the batch just trained) dropped, ``params`` (the weights
    from before that update) appended."""
    return tuple(behind[1:]) + (params,)


def with_params(state: RunState, params: nnx.State) -> RunState:
    """``state`` whose actor holds ``params`` as its trained parameters (its frozen ones kept): what samples."""
    return state.replace(actor=state.actor.replace(params=params))


def can_overlap(collector: Collector) -> bool:
    """Whether the next rollout may run on a thread beside the update (see the module docstring)."""
    if jax.process_count() > 1 and collector.weight_move is None:
        return False  # an engine's weight push gathers over processes, and a shared mesh's programs would interleave
    elsewhere = collector.engine.pushes_weights or collector.weight_move is not None  # not the training mesh
    return collector.mesh.devices.size == 1 or (elsewhere and collector.reward_model is None)


@dataclasses.dataclass
class Generated:
    """A batch as :func:`~jppo.run.collect.collect` takes it, its phase seconds and when it was ready."""

    sampled: tuple
    seconds: dict
    finished_at: float


@dataclasses.dataclass
class Moved:
    """Weights moved to the rollout mesh (:meth:`~jppo.run.collect.Collector.sampling_weights`: the weights and
    the move's metrics) and the move's phase seconds."""

    weights: tuple
    seconds: dict


def move(collector: Collector, state: RunState) -> Optional[Moved]:
    """``state``'s weights moved to the rollout mesh now, on the calling thread (None without a mesh of its own).
    The next rollout's move is made before the update is dispatched, never beside it: with several processes it
    gathers the weights over the training mesh, and two programs with collectives over the same processes,
    dispatched from two threads, could reach them in other orders on each process."""
    if collector.weight_move is None:
        return None
    timer = PhaseTimer()
    weights = collector.sampling_weights(state.actor.weights, timer)
    return Moved(weights, timer.seconds)


def generate(collector: Collector, state: RunState, step: int, moved: Optional[Moved] = None) -> Generated:
    """Step ``step``'s batch, sampled and scored with ``state``'s weights (``moved``: those weights already on the
    rollout mesh, :func:`move`), key and data position."""
    timer = PhaseTimer()
    if moved is not None:
        merge(timer, moved.seconds)
    sampled = sample_and_score(collector, state, step, timer, None if moved is None else moved.weights)
    return Generated(sampled, timer.seconds, time.perf_counter())


class OffPolicy:
    """The rollouts of a run with k >= 1 off-policy steps: each step takes its batch (:meth:`take`), starts the
    next one from the weights the schedule names (:meth:`start_next`, before the update) and, after the update,
    waits for it and moves the queue on (:meth:`finish`). A context manager: leaving waits for a rollout in
    flight (also when the step failed), so no thread outlives the run."""

    def __init__(self, collector: Collector, k: int, total_steps: int, overlap: bool):
        self.collector, self.k, self.total_steps = collector, k, total_steps
        self._pool = concurrent.futures.ThreadPoolExecutor(1, "jppo-rollout") if overlap else None
        self._pending: Optional[concurrent.futures.Future] = None
        self._ready: Optional[tuple[int, Generated]] = None
        self._train_wait = 0.0

    def __enter__(self) -> "OffPolicy":
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def take(self, state: RunState, timer: PhaseTimer) -> tuple:
        """Step ``state.step + 1``'s batch: the one generated during the last step, or (the run's first step,
        or the first after a resume) generated now from the queue's head, the training waiting for it."""
        step = int(state.step) + 1
        if self._ready is not None and self._ready[0] == step:
            return self._ready[1].sampled
        started = time.perf_counter()
        batch = generate(self.collector, with_params(state, state.behind[0]), step)
        self._train_wait = time.perf_counter() - started
        merge(timer, batch.seconds)
        return batch.sampled

    def start_next(self, state: RunState) -> nnx.State:
        """After step ``t``'s collection (``state``: its data position advanced): starts step ``t + 1``'s batch from
        the weights after ``u(t + 1)`` updates, and returns the copy of the weights before step ``t``'s update
        that the queue will hold (:meth:`finish`)."""
        before = copied(state.actor.params)
        step = int(state.step) + 2
        self._ready = self._pending = None
        if step <= self.total_steps:  # no batch past the last step
            behaviour = with_params(state, pushed(state.behind, before)[0])
            moved = move(self.collector, behaviour)
            job = lambda: generate(self.collector, behaviour, step, moved)  # noqa: E731
            if self._pool is not None:
                self._pending = self._pool.submit(job)
            else:  # in turn: the training side waits for the whole generation
                started = time.perf_counter()
                self._pending = concurrent.futures.Future()
                self._pending.set_result(job())
                self._train_wait += time.perf_counter() - started
        return before

    def finish(self, state: RunState, before: nnx.State, timer: PhaseTimer) -> tuple[RunState, dict[str, float]]:
        """After step ``t``'s update: waits for step ``t + 1``'s batch, moves the queue on, and step ``t``'s
        ``async/*`` metrics (``train_wait_s``: seconds the training waited for a rollout; ``rollout_wait_s``:
        seconds the finished rollout waited for the training)."""
        step, rollout_wait = int(state.step), 0.0
        if self._pending is not None:
            reached = time.perf_counter()
            batch = self._pending.result()
            self._train_wait += time.perf_counter() - reached
            rollout_wait = max(0.0, reached - batch.finished_at)
            merge(timer, batch.seconds)
            self._ready, self._pending = (step + 1, batch), None
        metrics = {"async/staleness": float(staleness(step, self.k)), "async/train_wait_s": self._train_wait,
                   "async/rollout_wait_s": rollout_wait}
        self._train_wait = 0.0
        return state.replace(behind=pushed(state.behind, before)), metrics


def merge(timer: PhaseTimer, seconds: dict) -> None:
    """Adds a generation's phase seconds (``rollout``, ``reward``, ``weight_push``, ``weight_move``) to the step's
    timer."""
    for phase, value in seconds.items():
        timer.seconds[phase] = timer.seconds.get(phase, 0.0) + value
