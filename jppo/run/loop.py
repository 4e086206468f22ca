"""The PPO / GRPO training loop (``python -m jppo.train`` runs it).

The loop, as :func:`run` reads::

    state = init or restore                               # RunState: models, optimizers, KL, data position, step
    while state.step < trainer.total_steps:
        state, experience, metrics = collect(state)       # sample, score, forward passes, KL in reward, advantages
        state, metrics = learn(state, experience)         # ppo_epochs x mini-batches: critic, then actor
        for hook in hooks: hook(state, metrics)           # evaluate, log, checkpoint, each every N steps;
                                                          # on a signal: checkpoint, stop

The life around the step (output folder, resume, hooks, the export at the end) is the SFT run's too:
:mod:`jppo.run.lifecycle`.

With ``trainer.off_policy_steps`` k >= 1 the batch of a step is the one generated during the step before, from
older weights (:mod:`jppo.run.offpolicy`; :func:`train_step`), on a schedule fixed by the seed, the step and k.

Collection (:mod:`jppo.run.collect`) works on the whole rollout batch; learning (:mod:`jppo.run.learn`) cuts it into
mini- and micro-batches in the engine. Restarting the same command resumes from the newest complete checkpoint
(``trainer.resume: auto``): the whole :class:`~jppo.run.state.RunState` is restored, and every random draw is a
function of (seed, step), so the resumed run continues exactly as an uninterrupted one would.
"""

from __future__ import annotations

import contextlib
import logging
from functools import partial
from typing import Optional, Sequence

import jax
from flax import nnx
from jax.sharding import Mesh

from jppo.config import TrainConfig
from jppo.config.views import engine_view, kl_controller, sampling_config
from jppo.engine import init_train_state
from jppo.run import build
from jppo.run.collect import Collector, collect
from jppo.run.evaluate import evaluate_and_log
from jppo.run.learn import Learner, learn
from jppo.run.lifecycle import Resume, finish, optimizer_steps, restored, started, train
from jppo.run.offpolicy import OffPolicy, can_overlap, initial_behind
from jppo.run.record import run_model_record
from jppo.run.rollout_mesh import WeightMove, run_meshes
from jppo.run.state import RunState, init_run_state, rescheduled
from jppo.runlog.timing import PhaseTimer

log = logging.getLogger("jppo.run.loop")


def setup(
    cfg: TrainConfig, mesh: Mesh, inputs: build.RunInputs, seed: Optional[int] = None,
    rollout_mesh: Optional[Mesh] = None,
) -> tuple[RunState, Collector, Learner, nnx.GraphDef]:
    """The run's initial state, its collection and learning stages, and the policy's structure (for the export).
    ``seed``: what the models' random weights are drawn from (default ``trainer.seed``; a checkpoint's models:
    the seed it records, :func:`~jppo.run.lifecycle.read_resume`). ``rollout_mesh``: the samplers' own
    (``rollout.devices``), None: they run on ``mesh``."""
    seed = cfg.trainer.seed if seed is None else seed
    models = build.models(cfg, inputs.tokenizer, mesh, seed)
    graphdef, critic_graphdef, critic = models.actor.graphdef, None, None
    if models.critic is not None:
        critic_graphdef = models.critic.graphdef
        critic = init_train_state(models.critic.params, engine_view(cfg, "critic"), mesh, frozen=models.critic.frozen)
    actor = init_train_state(models.actor.params, engine_view(cfg, "actor"), mesh, frozen=models.actor.frozen)
    behind = initial_behind(actor.params, cfg.trainer.off_policy_steps)
    state = init_run_state(actor, critic, kl_controller(cfg).init(), cfg.trainer.seed, mesh, behind)
    collector = Collector.create(
        cfg, mesh, inputs, graphdef, critic_graphdef, models.reference,
        sampling=build.sampling_graphdef(cfg, models.policy), base=models.base,
        engine=build.rollout_engine(cfg, models.policy), weight_move=weight_move(cfg, models, rollout_mesh),
    )
    return state, collector, Learner.create(cfg, mesh, graphdef, critic_graphdef), graphdef


def weight_move(cfg: TrainConfig, models: build.Models, rollout_mesh: Optional[Mesh]) -> Optional[WeightMove]:
    """The policy's weights to ``rollout_mesh`` (None: no move) in the rollout dtype; with LoRA as they are (the
    sampler forms the adapters' product in float32, :mod:`jppo.run.rollout_mesh`)."""
    if rollout_mesh is None:
        return None
    dtype = None if models.base is not None else sampling_config(cfg, models.policy.config).dtype
    return WeightMove(rollout_mesh, dtype)


def restore(
    cfg: TrainConfig, mesh: Mesh, inputs: build.RunInputs, resume: Resume, rollout_mesh: Optional[Mesh] = None
) -> tuple[RunState, Collector, Learner, nnx.GraphDef, dict]:
    """:func:`setup` with the models ``resume`` says, the checkpoint's state restored into it
    (:func:`~jppo.run.lifecycle.restored`), and the run's :func:`~jppo.run.record.run_model_record`."""
    state, collector, learner, graphdef = setup(cfg, mesh, inputs, resume.seed, rollout_mesh)
    record = run_model_record(cfg, state, resume.seed)
    state = restored(state, resume, record)
    if resume.checkpoint is not None:  # another ppo_epochs: the same schedule of learning rates
        state = rescheduled(state, resume.optimizer_steps, optimizer_steps(cfg))
    return state, collector, learner, graphdef, record


def run(
    cfg: TrainConfig, mesh_shape: tuple[int, int, int, int], inputs: build.RunInputs,
    devices: Optional[Sequence[jax.Device]] = None,
) -> dict[str, float]:
    """Trains to ``trainer.total_steps`` on ``devices`` (default: all; with ``rollout.devices`` N, the last N form
    the rollout's mesh), resuming when a checkpoint exists; returns the last step's metrics."""
    with started(cfg) as this_run:
        mesh, rollout_mesh = run_meshes(list(jax.devices() if devices is None else devices), mesh_shape,
                                        cfg.rollout.devices)
        state, collector, learner, policy, record = restore(cfg, mesh, inputs, this_run.resume, rollout_mesh)
        evaluate = None if inputs.val_data is None else partial(evaluate_and_log, collector)
        with off_policy(cfg, collector) as rollouts:

            def step(s: RunState, timer: PhaseTimer) -> tuple[RunState, dict[str, float]]:
                return train_step(collector, learner, s, timer, rollouts)

            state, metrics = train(this_run, state, step, evaluate, record)
    finish(cfg, policy, state.actor.weights, inputs.tokenizer, this_run.out, this_run.main)
    return metrics


def off_policy(cfg: TrainConfig, collector: Collector) -> contextlib.AbstractContextManager:
    """The run's :class:`~jppo.run.offpolicy.OffPolicy` rollouts with k >= 1 off-policy steps; None at k = 0."""
    k = cfg.trainer.off_policy_steps
    if not k:
        return contextlib.nullcontext()
    overlap = can_overlap(collector)
    log.info("trainer.off_policy_steps=%d: the next rollout runs %s", k,
             "beside the update" if overlap else "in turn with the update (they share the training mesh)")
    return OffPolicy(collector, k, cfg.trainer.total_steps, overlap=overlap)


def train_step(
    collector: Collector, learner: Learner, state: RunState, timer: PhaseTimer, rollouts: Optional[OffPolicy] = None
) -> tuple[RunState, dict[str, float]]:
    """One training step: collect, then learn; with off-policy ``rollouts``, on the batch generated during the last
    step, the next one generated (beside the update where it can) from weights the update does not change."""
    if rollouts is None:
        state, experience, metrics = collect(collector, state, timer)
        state, learned = learn(learner, state, experience, timer)
        return state, learned | metrics
    state, experience, metrics = collect(collector, state, timer, rollouts.take(state, timer))
    before = rollouts.start_next(state)
    state, learned = learn(learner, state, experience, timer)
    state, waits = rollouts.finish(state, before, timer)
    return state, learned | metrics | waits
