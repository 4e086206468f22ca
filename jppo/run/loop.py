"""The PPO / GRPO training loop (``python -m jppo.train`` runs it).

The loop, as :func:`run` reads::

    state = init or restore                               # RunState: models, optimizers, KL, data position, step
    while state.step < trainer.total_steps:
        state, experience, metrics = collect(state)       # sample, score, forward passes, KL in reward, advantages
        state, metrics = learn(state, experience)         # ppo_epochs x mini-batches: critic, then actor
        for hook in hooks: hook(state, metrics)           # evaluate, log, checkpoint, each every N steps;
                                                          # on a signal: checkpoint, stop (jppo.run.preemption)

With ``trainer.off_policy_steps`` k >= 1 the batch of a step is the one generated during the step before, from
older weights (:mod:`jppo.run.offpolicy`; :func:`train_step`), on a schedule fixed by the seed, the step and k.

Collection (:mod:`jppo.run.collect`) works on the whole rollout batch; learning (:mod:`jppo.run.learn`) cuts it into
mini- and micro-batches in the engine. Restarting the same command resumes from the newest complete checkpoint
(``trainer.resume: auto``): the whole :class:`~jppo.run.state.RunState` is restored, and every random draw is a
function of (seed, step), so the resumed run continues exactly as an uninterrupted one would.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Callable, Optional, Sequence

import jax
from etils import epath
from flax import nnx
from jax.sharding import Mesh

from jppo.run import build
from jppo.parallel import distributed
from jppo.parallel.hostlocal import gather_to_host
from jppo.run.checkpoint import (
    SFT_META, CheckpointManager, fingerprint, read_meta, resolve_resume, restore_checkpoint, saved_tree,
)
from jppo.run.collect import Collector, collect
from jppo.run.offpolicy import OffPolicy, can_overlap, initial_behind
from jppo.run.preemption import StopRequest
from jppo.run.rollout_mesh import WeightMove, run_meshes
from jppo.runlog.timing import PhaseTimer
from jppo.run.evaluate import evaluate
from jppo.config import ConfigError, TrainConfig, save_config, to_dict
from jppo.data import Tokenizer
from jppo.engine import init_train_state
from jppo.run.export import export_policy, merged_policy
from jppo.run.learn import Learner, learn
from jppo.core.paths import run_path
from jppo.runlog import RunLogger
from jppo.run.state import (
    RunState, checkpointed, fitted_accumulators, init_run_state, rescheduled, saved_fields, saved_layout, with_frozen,
)
from jppo.config.views import engine_view, kl_controller, optimizer_steps_per_training_step, sampling_config

log = logging.getLogger("jppo.run.loop")
OFF_POLICY_META = "off_policy_steps"  # in a checkpoint's meta when k >= 1 (absent: 0, as before the key existed)
# optimizer steps per training step of each role, by role (absent in older checkpoints: taken as this run's)
OPTIMIZER_STEPS_META = "optimizer_steps_per_training_step"


@dataclasses.dataclass(frozen=True)
class Hook:
    """``fn(step, state, metrics)`` after every ``every``-th training step (0: never), and after the last one when
    ``at_end``. Hooks run in order; an evaluation hook adds its metrics before the logging hook writes them."""

    every: int
    fn: Callable[[int, RunState, dict], None]
    at_end: bool = False

    def __call__(self, step: int, total: int, state: RunState, metrics: dict) -> None:
        if (self.every and step % self.every == 0) or (self.at_end and step == total):
            self.fn(step, state, metrics)


def setup(
    cfg: TrainConfig, mesh: Mesh, inputs: build.RunInputs, seed: Optional[int] = None,
    rollout_mesh: Optional[Mesh] = None,
) -> tuple[RunState, Collector, Learner, nnx.GraphDef]:
    """The run's initial state, its collection and learning stages, and the policy's structure (for the export).
    ``seed``: what the models' random weights are drawn from (default ``trainer.seed``; a checkpoint's models:
    the seed it records, :func:`plan_resume`). ``rollout_mesh``: the samplers' own (``rollout.devices``), None:
    they run on ``mesh``."""
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


@dataclasses.dataclass(frozen=True)
class Resume:
    """The checkpoint a run continues from (None: a fresh run), the seed its models are drawn from and the
    :func:`jppo.run.build.model_record` the checkpoint holds (None without one), and the optimizer steps per
    training step of its roles (:func:`~jppo.run.state.rescheduled`; empty: this run's)."""

    checkpoint: Optional[str]
    seed: int
    saved: Optional[dict]
    optimizer_steps: dict = dataclasses.field(default_factory=dict)


def plan_resume(cfg: TrainConfig, checkpoints: epath.Path) -> Resume:
    """What ``trainer.resume`` continues from, with ``checkpoints`` the run's checkpoint directory. Reads only the
    checkpoint's meta: a config that would build other models is refused here (:class:`ConfigError`), before
    anything is written, built or compiled."""
    resume = resolve_resume(cfg.trainer.resume, checkpoints)
    if resume is None:
        return Resume(None, cfg.trainer.seed, None)
    checkpoint = str(checkpoints / str(resume) if isinstance(resume, int) else resume)
    meta = read_meta(checkpoint)
    saved_k, k = meta.get(OFF_POLICY_META, 0), cfg.trainer.off_policy_steps
    if saved_k != k:  # its weight queue holds saved_k batches' weights; another k has another schedule
        raise ConfigError(f"trainer.off_policy_steps={k}: checkpoint {checkpoint!r} was written with "
                          f"trainer.off_policy_steps={saved_k} (resume with that, or trainer.resume=never)")
    seed, saved = build.checkpoint_models(cfg, meta, f"trainer.resume: checkpoint {checkpoint!r}")
    return Resume(checkpoint, seed, saved, meta.get(OPTIMIZER_STEPS_META, {}))


def run_model_record(cfg: TrainConfig, state: RunState, seed: int) -> dict:
    """:func:`jppo.run.build.model_record` of a built run, with the checksums of its LoRA bases loaded from files."""
    loaded = {"actor": cfg.model.path, "critic": cfg.critic.model_path or cfg.model.path}
    frozen = {"actor": state.actor.frozen, "critic": None if state.critic is None else state.critic.frozen}
    checksums = {role: fingerprint(frozen[role]) for role in build.ROLES if loaded[role] and frozen[role] is not None}
    return build.model_record(cfg, seed, checksums)


def restore(
    cfg: TrainConfig, mesh: Mesh, inputs: build.RunInputs, resume: Resume, rollout_mesh: Optional[Mesh] = None
) -> tuple[RunState, Collector, Learner, nnx.GraphDef, dict]:
    """:func:`setup` with the models ``resume`` says, the checkpoint's state restored into it (after its LoRA
    bases were checked against their recorded checksums), and the run's :func:`run_model_record`."""
    state, collector, learner, graphdef = setup(cfg, mesh, inputs, resume.seed, rollout_mesh)
    record = run_model_record(cfg, state, resume.seed)
    if resume.checkpoint is not None:
        if resume.saved is not None:
            build.check_base_checksums(resume.saved, record, f"trainer.resume: checkpoint {resume.checkpoint!r}")
        saved = saved_tree(resume.checkpoint)
        target = saved_layout(checkpointed(state), saved)  # K = 1: no accumulator
        restored = RunState(**restore_checkpoint(resume.checkpoint, saved_fields(target, saved))[0])
        state = with_frozen(fitted_accumulators(restored, state), state)
        state = rescheduled(state, resume.optimizer_steps, optimizer_steps(cfg))  # another ppo_epochs: same schedule
    return state, collector, learner, graphdef, record


def run(
    cfg: TrainConfig, mesh_shape: tuple[int, int, int, int], inputs: build.RunInputs,
    devices: Optional[Sequence[jax.Device]] = None,
) -> dict[str, float]:
    """Trains to ``trainer.total_steps`` on ``devices`` (default: all; with ``rollout.devices`` N, the last N form
    the rollout's mesh), resuming when a checkpoint exists; returns the last step's metrics."""
    out = run_path(cfg.trainer.output_dir)  # a local folder or a cloud URI, shared by every host
    resume = plan_resume(cfg, out / "checkpoints")  # a checkpoint the config does not fit: refused, nothing written
    main = distributed.is_main_process()
    if main:
        out.mkdir(parents=True, exist_ok=True)
        save_config(cfg, out / "config.yaml")
    mesh, rollout_mesh = run_meshes(list(jax.devices() if devices is None else devices), mesh_shape,
                                    cfg.rollout.devices)
    manager = CheckpointManager(out / "checkpoints", max_to_keep=cfg.trainer.max_checkpoints_to_keep,
                                async_save=cfg.trainer.async_checkpoint)
    with manager, StopRequest() as stop:  # leaving waits for a save in flight; a signal stops at a step boundary
        state, collector, learner, policy, record = restore(cfg, mesh, inputs, resume, rollout_mesh)
        if resume.checkpoint is not None:
            log.info("resumed from %s at step %d", resume.checkpoint, state.steps_done)
        fresh, total, metrics = state.steps_done == 0, cfg.trainer.total_steps, {}
        with run_logger(cfg, start_step=0 if fresh else state.steps_done + 1) as logger:
            has_val = inputs.val_data is not None
            hooks = [
                Hook(cfg.trainer.val_every if has_val else 0,
                     lambda step, s, m: m.update(evaluate_and_log(collector, s, logger, step))),
                Hook(1, lambda step, s, m: logger.log(step, m)),
                Hook(cfg.trainer.save_every, lambda step, s, m: save(manager, s, cfg, record), at_end=True),
                # preemption (jppo.run.preemption): every process saves this step and leaves with Preempted
                Hook(1, lambda step, s, m: stop.at_boundary(step, total, lambda: save(manager, s, cfg, record),
                                                            manager.wait)),
            ]
            if cfg.trainer.val_before_train and has_val and fresh:
                # the initial policy's evaluation, at step 0 (verl's global step 0); a resumed run does not repeat it
                logger.log(0, evaluate_and_log(collector, state, logger, 0))
            with off_policy(cfg, collector) as rollouts:
                while state.steps_done < total:
                    timer = PhaseTimer()
                    state, metrics = train_step(collector, learner, state, timer, rollouts)
                    metrics = metrics | timer.report(tokens=metrics["perf/total_num_tokens"])
                    for hook in hooks:
                        hook(state.steps_done, total, state, metrics)
    finish(cfg, policy, state.actor.weights, inputs.tokenizer, out, main)
    return metrics


def finish(cfg: TrainConfig, policy, weights, tokenizer: Tokenizer, out, main: bool) -> None:
    """After a run's last step (RL or SFT): the Hugging Face export and, on the main process, the plots the
    config asks for."""
    if cfg.trainer.export_hf:
        export(policy, weights, cfg, tokenizer, out / "hf")
    if cfg.trainer.plots and main:
        from jppo.runlog.plot import plot_run  # noqa: PLC0415 (matplotlib, only when plotting)

        plot_run(out)


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
    collector: Collector, learner: Learner, state: RunState, timer: PhaseTimer, rollouts: Optional[OffPolicy]
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


def run_logger(cfg: TrainConfig, start_step: int) -> RunLogger:
    """The run's logger: the sinks of ``trainer.logger``, written by the main process only."""
    t = cfg.trainer
    return RunLogger(
        t.output_dir, total_steps=t.total_steps, sinks=t.logger, progress_bar=t.progress_bar, start_step=start_step,
        is_main_process=distributed.is_main_process(), project_name=t.project_name,
        experiment_name=t.experiment_name, config=to_dict(cfg),
    )


def evaluate_and_log(collector: Collector, state: RunState, logger: RunLogger, step: int) -> dict[str, float]:
    """The policy's held-out evaluation metrics; its first ``trainer.log_val_generations`` responses (the main
    process's rows, in validation-set order: the same prompts every time) go to the logger as step ``step``'s
    sample."""
    result = evaluate(collector, state.actor.weights)
    sample = result.records[: collector.cfg.trainer.log_val_generations]
    logger.log_generations(step, [{k: r[k] for k in ("prompt", "response", "reward", "finished")} for r in sample])
    return result.metrics


def save(manager: CheckpointManager, state: RunState, cfg: TrainConfig, record: Optional[dict] = None,
         sft: bool = False) -> None:
    """Checkpoint of ``state`` (unless that step is already saved) with what its models were built from
    (``record``, default: :func:`run_model_record` with ``trainer.seed``; how to rebuild what it leaves out); the
    config travels along for humans. ``sft``: written by ``python -m jppo.sft`` (:data:`~jppo.run.checkpoint.SFT_META`), whose
    ``config.yaml`` is then read as an SFT config."""
    step = state.steps_done
    if manager.latest_step() != step:
        record = run_model_record(cfg, state, cfg.trainer.seed) if record is None else record
        meta = {"step": step, build.MODELS_META: record, "config": to_dict(cfg),
                OPTIMIZER_STEPS_META: optimizer_steps(cfg)}
        if sft:
            meta[SFT_META] = True
        if cfg.trainer.off_policy_steps:
            meta[OFF_POLICY_META] = cfg.trainer.off_policy_steps
        manager.save(step, checkpointed(state), meta)


def optimizer_steps(cfg: TrainConfig) -> dict[str, int]:
    """Optimizer steps per training step of each role the run trains."""
    roles = ("actor", "critic") if cfg.use_critic else ("actor",)
    return {role: optimizer_steps_per_training_step(cfg, role) for role in roles}


def export(
    graphdef: nnx.GraphDef, params: nnx.State, cfg: TrainConfig, tokenizer: Tokenizer, path: epath.Path
) -> None:
    """The policy as a Hugging Face directory, as ``python -m jppo.export`` writes it (parameters gathered tensor
    by tensor; the main process writes; LoRA adapters merged into their kernels)."""
    params = jax.tree.map(gather_to_host, params)
    if jax.process_index() == 0:
        export_policy(merged_policy(nnx.merge(graphdef, params)), cfg, tokenizer, path)

