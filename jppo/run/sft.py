"""Supervised fine-tuning (``python -m jppo.sft`` runs it): the RL run's update engine on demonstrations.

The loop, as :func:`run` reads::

    state = init or restore                                  # RunState: the policy, its optimizer, data position, step
    while state.step < trainer.total_steps:
        batch = the sft.batch_size rows after data_position   # an order fixed by trainer.seed and the epoch
        state, metrics = run_updates(state, batch)           # ONE optimizer step: K micro-batches, NormStats once
        for hook in hooks: hook(state, metrics)              # held-out loss and greedy score, log, checkpoint;
                                                             # on a signal: save, stop

The update is the actor's (:class:`~jppo.engine.update.UpdateStep` with :func:`~jppo.engine.objectives.sft_loss_fn`):
the same mesh, micro-batching (``actor.ppo_micro_batch_size``, or ``actor.use_dynamic_bsz`` with its token budget),
``optax.MultiSteps`` accumulation, ``actor.loss_agg_mode`` over the whole mini-batch's token count, optimizer,
LoRA, checkpoints and loggers; a checkpoint is a :class:`~jppo.run.state.RunState` without a critic, so the same
command resumes it exactly, ``python -m jppo.export`` writes it as a Hugging Face directory, and an RL run starts
from that directory (``model.path``), as from any checkpoint.

When the rows are demonstrations of ``data.task`` (no ``sft.train_files``), validation also samples the policy on
the task's held-out prompts and scores the responses as the RL run's validation does (:mod:`jppo.run.evaluate`,
``rollout.val_*``, greedy by default): ``val/reward/mean``, the held-out greedy score an RL run from this policy
starts at.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from jppo.config import ConfigError, TrainConfig
from jppo.config.devices import check_experts, check_heads
from jppo.config.views import engine_view, kl_controller, tokenizer_spec
from jppo.core.errors import one_line
from jppo.core.inputs import file_list
from jppo.data import Tokenizer, load_dataset, load_tokenizer, task_of
from jppo.data.sft import SFTData, load_sft_data
from jppo.engine import UpdateStep, init_train_state, run_updates, sft_loss_fn
from jppo.engine.config import ActorConfig
from jppo.engine.driver import check_batch_sizes
from jppo.engine.forward import forward_batch, log_prob_fn
from jppo.parallel.hostlocal import local_rows, sum_over_processes
from jppo.parallel.mesh import batch_shards, make_mesh, resolve_shape, row_shards_of
from jppo.run import build
from jppo.run.collect import Collector
from jppo.run.evaluate import evaluate_and_log
from jppo.run.learn import mini_batch_rng
from jppo.run.lifecycle import Resume, finish, restored, started, train
from jppo.run.record import run_model_record
from jppo.run.state import RunState, advance, init_run_state
from jppo.runlog import RunLogger
from jppo.runlog.timing import PhaseTimer

log = logging.getLogger("jppo.run.sft")


@dataclasses.dataclass(frozen=True)
class SFTInputs:
    """What an SFT run reads: the tokenizer, the training rows, the held-out rows (None: no held-out loss) and the
    task's held-out prompts with its scorer (None: no held-out score; the rows are not a task's demonstrations)."""

    tokenizer: Tokenizer
    train: SFTData
    val: Optional[SFTData]
    scored: Optional[build.RunInputs] = None


def sft_config(cfg: TrainConfig) -> TrainConfig:
    """The config an SFT run trains (and records) under: ``cfg`` without a critic, which it does not train."""
    return dataclasses.replace(cfg, critic=dataclasses.replace(cfg.critic, enable=False))


def sft_view(cfg: TrainConfig) -> ActorConfig:
    """The engine's config of an SFT step: the actor's settings, ``sft.batch_size`` rows per optimizer step, one
    optimizer step per training step, and C (``seq-mean-token-sum-norm``'s constant) ``actor.loss_scale_factor``
    or ``sft.max_length``."""
    view = engine_view(cfg, "actor")
    return dataclasses.replace(
        view, ppo_mini_batch_size=cfg.sft.batch_size, ppo_epochs=1, optimizer_steps_per_training_step=1,
        loss_scale_factor=float(cfg.actor.loss_scale_factor or cfg.sft.max_length), old_log_prob="recompute",
    )


def row_limits(cfg: TrainConfig) -> dict[str, int]:
    """The keys that bound a row's tokens: ``sft.max_length``, and the token budget of a cut by tokens."""
    limits = {"sft.max_length": cfg.sft.max_length}
    if cfg.actor.use_dynamic_bsz:
        limits["actor.ppo_max_token_len"] = cfg.actor.ppo_max_token_len
    return limits


def load_inputs(cfg: TrainConfig) -> SFTInputs:
    """The tokenizer and the rows; every problem of the data a :class:`ConfigError` of one line (file, row, key)."""
    try:
        tokenizer = load_tokenizer(tokenizer_spec(cfg))
        train = load_sft_data(cfg.sft, cfg.data, tokenizer, "train", row_limits(cfg))
        wants_val = cfg.trainer.val_every > 0 or cfg.trainer.val_before_train
        val = load_sft_data(cfg.sft, cfg.data, tokenizer, "val", row_limits(cfg)) if wants_val else None
        scored = task_prompts(cfg, tokenizer) if wants_val else None
    except (ValueError, KeyError, FileNotFoundError) as error:
        raise ConfigError(one_line(error)) from None
    return SFTInputs(tokenizer, train, val, scored)


def demonstrates_task(cfg: TrainConfig) -> bool:
    """Whether the rows are demonstrations of ``data.task`` (not ``sft.train_files``, whose rows no scorer
    knows), so that validation can score the policy on the task's held-out prompts."""
    return task_of(cfg.data) is not None and not file_list(cfg.sft.train_files, "sft.train_files")


def task_prompts(cfg: TrainConfig, tokenizer: Tokenizer) -> Optional[build.RunInputs]:
    """The held-out prompts of ``data.task`` and its reward, as an RL run validates on them, when the rows are
    that task's demonstrations (:func:`demonstrates_task`); None otherwise."""
    if not demonstrates_task(cfg):
        return None
    task = task_of(cfg.data)
    return build.RunInputs(tokenizer, None, load_dataset(cfg.data, tokenizer, "val"), build.reward_of(cfg, task))


def mesh_shape(cfg: TrainConfig, num_devices: int) -> tuple[int, int, int, int, int]:
    """The mesh for ``num_devices``, with ``sft.batch_size`` checked against its batch shards and ``mesh.tensor``
    against the model's heads."""
    try:
        shape = resolve_shape(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, num_devices, cfg.mesh.sequence,
                              cfg.mesh.expert)
        view = sft_view(cfg)
        check_batch_sizes(view, view.ppo_mini_batch_size, row_shards_of(shape), "actor",
                          f"sft.batch_size={cfg.sft.batch_size} rows")
    except ValueError as error:
        raise ConfigError(one_line(error)) from None
    check_heads(cfg, shape[2])
    check_experts(cfg, shape[4])
    if shape[3] > 1 and not (cfg.actor.use_dynamic_bsz and cfg.actor.ppo_max_token_len % shape[3] == 0):
        raise ConfigError(f"mesh.sequence={shape[3]}: SFT splits the tokens of packed rows only: set "
                          f"actor.use_dynamic_bsz=true with an actor.ppo_max_token_len that mesh.sequence divides")
    return shape


def restore(cfg: TrainConfig, mesh: Mesh, inputs: SFTInputs, resume: Resume, view: ActorConfig):
    """The policy (``model.path`` or random, LoRA as configured) in a fresh :class:`RunState`, or the checkpoint
    ``resume`` names restored into it; with the run's models (the policy's structure, and the sampler's) and its
    model record."""
    models = build.models(cfg, inputs.tokenizer, mesh, resume.seed, roles=("actor",), reference=False)
    actor = init_train_state(models.actor.params, view, mesh, frozen=models.actor.frozen)
    state = init_run_state(actor, None, kl_controller(cfg).init(), cfg.trainer.seed, mesh)
    record = run_model_record(cfg, state, resume.seed)
    return restored(state, resume, record, roles=("actor",)), models, record


def train_step(update: UpdateStep, state: RunState, data: SFTData, cfg: TrainConfig, view: ActorConfig,
               mesh: Mesh) -> tuple[RunState, dict[str, float]]:
    """One optimizer step on the ``sft.batch_size`` rows after ``state.data_position`` (this process's share of
    them); the state one step and one batch on."""
    step, size = int(state.step) + 1, cfg.sft.batch_size
    rows = data.rows_at(int(np.asarray(state.data_position)), size, cfg.trainer.seed)
    batch = data.experience(rows[np.asarray(local_rows(mesh, size))])
    updated = run_updates(update, state.actor, batch, view, mesh, mini_batch_rng(cfg.trainer.seed, step, "sft"))
    metrics = dict(updated.metrics)
    metrics["sft/perplexity"] = math.exp(min(metrics["sft/nll"], 700.0))
    tokens = sum_over_processes([batch.response_mask.sum(), batch.lengths().sum()])
    metrics["sft/num_loss_tokens"], metrics["perf/total_num_tokens"] = float(tokens[0]), float(tokens[1])
    state = advance(state, actor=updated.state, data_position=int(np.asarray(state.data_position)) + size, step=step)
    return state, metrics


def held_out(fn, params, data: SFTData, view: ActorConfig, mesh: Mesh) -> dict[str, float]:
    """``val/sft_nll``: the token-mean ``-log p`` of every held-out loss token (summed over all rows, then divided
    once), and ``val/sft_perplexity``, its exponential. The rows are padded with empty ones to whole micro-batches
    of every batch shard."""
    unit = batch_shards(mesh) * view.ppo_micro_batch_size
    pad = -len(data) % unit
    rows = np.arange(len(data))
    window = local_rows(mesh, len(data) + pad)
    everything = data.experience(rows, pad_rows=pad)
    mine = everything.take(np.asarray(window))
    log_probs = forward_batch(fn, params, mine, mesh, micro_batch_size=view.ppo_micro_batch_size)
    mask = mine.response_mask.astype(bool)
    total, count = sum_over_processes([-np.sum(log_probs[mask], dtype=np.float64), mask.sum()])
    nll = float(total / max(count, 1))
    return {"val/sft_nll": nll, "val/sft_perplexity": math.exp(min(nll, 700.0))}


def run(
    cfg: TrainConfig, shape: tuple[int, int, int, int], inputs: SFTInputs,
    devices: Optional[Sequence[jax.Device]] = None,
) -> dict[str, float]:
    """Fine-tunes to ``trainer.total_steps`` on ``devices`` (default: all), resuming when a checkpoint exists;
    returns the last step's metrics."""
    cfg = sft_config(cfg)
    with started(cfg) as this_run:
        mesh = make_mesh(*shape, devices=devices)
        view = sft_view(cfg)
        state, models, record = restore(cfg, mesh, inputs, this_run.resume, view)
        graphdef = models.actor.graphdef
        update = UpdateStep(graphdef, sft_loss_fn(view), view, mesh, "sft")
        forward = log_prob_fn(graphdef, temperature=1.0, chunk_size=view.log_prob_chunk_size)
        scorer = None if inputs.scored is None else Collector.create(
            cfg, mesh, inputs.scored, graphdef, None, None, sampling=build.sampling_graphdef(cfg, models.policy))

        def evaluate(s: RunState, step: int, logger: RunLogger) -> dict[str, float]:
            metrics = held_out(forward, s.actor.weights, inputs.val, view, mesh)
            return metrics if scorer is None else metrics | evaluate_and_log(scorer, s, step, logger)

        def step(s: RunState, timer: PhaseTimer) -> tuple[RunState, dict[str, float]]:
            with timer("update_actor"):
                return train_step(update, s, inputs.train, cfg, view, mesh)

        state, metrics = train(this_run, state, step, None if inputs.val is None else evaluate, record, sft=True)
    finish(cfg, graphdef, state.actor.weights, inputs.tokenizer, this_run.out, this_run.main)
    return metrics
