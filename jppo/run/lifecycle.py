"""The life of a training run, RL or SFT alike: where it writes, what it resumes from, the steps and the hooks that
follow each (evaluate, log, checkpoint, stop on a signal), and what it leaves at the end.

Both loops (:mod:`jppo.run.loop`, :mod:`jppo.run.sft`) are this one life around their own step::

    with started(cfg) as run:                               # output folder, config.yaml, the checkpoint to resume
        state = restored(fresh state, run.resume, record)   # the checkpoint's RunState, onto this run's mesh
        state, metrics = train(run, state, step, evaluate, record)
    finish(cfg, policy, state.actor.weights, tokenizer, run.out, run.main)

:func:`train` runs ``step`` until ``trainer.total_steps`` and after each step the hooks, in order: the held-out
evaluation (``trainer.val_every``), the log and the checkpoint (``trainer.save_every`` and the last step). Whether to
stop is decided first: on SIGTERM / SIGUSR1 every process skips the step's evaluation, logs, saves the step and
leaves (:mod:`jppo.parallel.preemption`). Every random draw of a step is a function of (seed, step), so a resumed
run continues exactly as an uninterrupted one would.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Callable, Iterator, Optional, Sequence

import jax
from etils import epath
from flax import nnx

from jppo.config import ConfigError, TrainConfig, save_config, to_dict
from jppo.config.views import optimizer_steps_per_training_step
from jppo.core.paths import run_path
from jppo.data import Tokenizer
from jppo.parallel import distributed
from jppo.parallel.hostlocal import gather_to_host
from jppo.parallel.preemption import StopRequest
from jppo.run.build import ROLES
from jppo.run.checkpoint import (
    SFT_META,
    CheckpointManager,
    read_meta,
    resolve_resume,
    restore_checkpoint,
    saved_tree,
)
from jppo.run.export import export_policy, merged_policy
from jppo.run.record import (
    MODELS_META,
    check_base_checksums,
    checkpoint_models,
    run_model_record,
)
from jppo.run.state import (
    RunState,
    checkpointed,
    fitted_accumulators,
    saved_fields,
    saved_layout,
    with_frozen,
)
from jppo.runlog import RunLogger
from jppo.runlog.timing import PhaseTimer

log = logging.getLogger("jppo.run")
OFF_POLICY_META = "off_policy_steps"  # in a checkpoint's meta when k >= 1 (absent: 0, as before the key existed)
# optimizer steps per training step of each role, by role (absent in older checkpoints: taken as this run's)
OPTIMIZER_STEPS_META = "optimizer_steps_per_training_step"

Step = Callable[[RunState, PhaseTimer], tuple[RunState, dict]]  # one training step: the state one step on, metrics
Evaluate = Callable[[RunState, int, RunLogger], dict]  # held-out metrics of a state at a step (generations logged)


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


@dataclasses.dataclass(frozen=True)
class Resume:
    """The checkpoint a run continues from (None: a fresh run), the seed its models are drawn from and the
    :func:`jppo.run.record.model_record` the checkpoint holds (None without one), and the optimizer steps per
    training step of its roles (:func:`~jppo.run.state.rescheduled`; empty: this run's)."""

    checkpoint: Optional[str]
    seed: int
    saved: Optional[dict]
    optimizer_steps: dict = dataclasses.field(default_factory=dict)


def read_resume(cfg: TrainConfig, checkpoints: epath.Path) -> Resume:
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
    seed, saved = checkpoint_models(cfg, meta, f"trainer.resume: checkpoint {checkpoint!r}")
    return Resume(checkpoint, seed, saved, meta.get(OPTIMIZER_STEPS_META, {}))


@dataclasses.dataclass(frozen=True)
class Run:
    """A started run: its config, output folder (a local folder or a cloud URI, shared by every host), what it
    resumes from, whether this is the main process, its checkpoints and the stop request of a signal."""

    cfg: TrainConfig
    out: epath.Path
    resume: Resume
    main: bool
    checkpoints: CheckpointManager
    stop: StopRequest


@contextlib.contextmanager
def started(cfg: TrainConfig) -> Iterator[Run]:
    """The run ``cfg`` describes, started: what it resumes from (a checkpoint the config does not fit is refused
    before anything is written), its ``config.yaml`` (the main process writes it), its checkpoint manager and its
    stop request. Leaving waits for a checkpoint still being written."""
    out = run_path(cfg.trainer.output_dir)
    resume = read_resume(cfg, out / "checkpoints")
    main = distributed.is_main_process()
    if main:
        out.mkdir(parents=True, exist_ok=True)
        save_config(cfg, out / "config.yaml")  # an SFT config is read as one beside a checkpoint that says so
    manager = CheckpointManager(out / "checkpoints", max_to_keep=cfg.trainer.max_checkpoints_to_keep,
                                async_save=cfg.trainer.async_checkpoint)
    # a command's own stop request (entered at the top of its main()), or the run's
    request = contextlib.nullcontext(StopRequest.active) if StopRequest.active is not None else StopRequest()
    with manager, request as stop:
        yield Run(cfg, out, resume, main, manager, stop)


def restored(state: RunState, resume: Resume, record: dict, roles: Sequence[str] = ROLES) -> RunState:
    """``state`` (a fresh run's, on this run's mesh) with the checkpoint ``resume`` names restored into it, after
    its LoRA bases were checked against the checksums it records (only ``roles``, those built); ``state`` itself
    for a fresh run. The frozen bases are this run's (a checkpoint leaves them out)."""
    if resume.checkpoint is None:
        return state
    if resume.saved is not None:
        check_base_checksums(resume.saved, record, f"trainer.resume: checkpoint {resume.checkpoint!r}", roles)
    saved = saved_tree(resume.checkpoint)
    target = saved_layout(checkpointed(state), saved)  # K = 1: no accumulator
    restored = RunState(**restore_checkpoint(resume.checkpoint, saved_fields(target, saved))[0])
    log.info("resumed from %s at step %d", resume.checkpoint, int(restored.step))
    return with_frozen(fitted_accumulators(restored, state), state)


def train(run: Run, state: RunState, step: Step, evaluate: Optional[Evaluate], record: dict,
          sft: bool = False) -> tuple[RunState, dict[str, float]]:
    """``step`` until ``trainer.total_steps``, the hooks after each (module docstring); ``evaluate`` None: no
    held-out evaluation. Returns the last state and the last step's metrics."""
    cfg = run.cfg
    fresh, total, metrics = int(state.step) == 0, cfg.trainer.total_steps, {}
    saving = lambda s: save(run.checkpoints, s, cfg, record, sft)  # noqa: E731
    with run_logger(cfg, start_step=0 if fresh else int(state.step) + 1) as logger:
        validate = Hook(cfg.trainer.val_every if evaluate else 0, lambda n, s, m: m.update(evaluate(s, n, logger)))
        hooks = [
            validate,
            Hook(1, lambda n, s, m: logger.log(n, m)),
            Hook(cfg.trainer.save_every, lambda n, s, m: saving(s), at_end=True),
        ]
        with run.stop.deferred():
            if cfg.trainer.val_before_train and evaluate and fresh:
                # the initial policy's evaluation, at step 0 (verl's global step 0); a resumed run does not repeat it
                logger.log(0, evaluate(state, 0, logger))
            while int(state.step) < total:
                timer = PhaseTimer()
                state, metrics = step(state, timer)
                metrics = metrics | timer.report(tokens=metrics["perf/total_num_tokens"])
                n = int(state.step)
                # decided before the hooks, at the same step on every process: a stopping step does not validate
                # (a whole validation could outlast the grace period); asked again after them for a signal that
                # came during the log or the save
                stopping = n < total and run.stop.agreed()
                for hook in hooks:
                    if not (stopping and hook is validate):
                        hook(n, total, state, metrics)
                if n < total and (stopping or run.stop.agreed()):
                    run.stop.leave(n, lambda: saving(state), run.checkpoints.wait)
    return state, metrics


def run_logger(cfg: TrainConfig, start_step: int) -> RunLogger:
    """The run's logger: the sinks of ``trainer.logger``, written by the main process only."""
    t = cfg.trainer
    return RunLogger(
        t.output_dir, total_steps=t.total_steps, sinks=t.logger, progress_bar=t.progress_bar, start_step=start_step,
        is_main_process=distributed.is_main_process(), project_name=t.project_name,
        experiment_name=t.experiment_name, config=to_dict(cfg),
    )


def save(manager: CheckpointManager, state: RunState, cfg: TrainConfig, record: Optional[dict] = None,
         sft: bool = False) -> None:
    """Checkpoint of ``state`` (unless that step is already saved) with what its models were built from
    (``record``, default: :func:`~jppo.run.record.run_model_record` with ``trainer.seed``; how to rebuild what it
    leaves out); the config travels along for humans. ``sft``: written by ``python -m jppo.sft``
    (:data:`~jppo.run.checkpoint.SFT_META`), whose ``config.yaml`` is then read as an SFT config."""
    step = int(state.step)
    if manager.latest_step() != step:
        record = run_model_record(cfg, state, cfg.trainer.seed) if record is None else record
        meta = {"step": step, MODELS_META: record, "config": to_dict(cfg),
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


def finish(cfg: TrainConfig, policy: nnx.GraphDef, weights: nnx.State, tokenizer: Tokenizer, out: epath.Path,
           main: bool) -> None:
    """After a run's last step: the Hugging Face export and, on the main process, the plots the config asks for."""
    if cfg.trainer.export_hf:
        export(policy, weights, cfg, tokenizer, out / "hf")
    if cfg.trainer.plots and main:
        from jppo.runlog.plot import plot_run  # noqa: PLC0415 (matplotlib, only when plotting)

        plot_run(out)


def export(
    graphdef: nnx.GraphDef, params: nnx.State, cfg: TrainConfig, tokenizer: Tokenizer, path: epath.Path
) -> None:
    """The policy as a Hugging Face directory, as ``python -m jppo.export`` writes it (parameters gathered tensor
    by tensor; the main process writes; LoRA adapters merged into their kernels)."""
    params = jax.tree.map(gather_to_host, params)
    if jax.process_index() == 0:
        export_policy(merged_policy(nnx.merge(graphdef, params)), cfg, tokenizer, path)
