"""From a rollout batch to optimizer steps: epochs, shuffled mini-batches, micro-batches, metrics.

Host-side orchestration only; everything per token runs on the devices. The host decides the cut of all
mini-batches of all epochs from the rows' lengths (which sequence goes to which slot); the rows cross to the
devices once, the micro-batches of every step are assembled there (:mod:`jppo.engine.assemble`), and ONE compiled
call (:class:`~jppo.engine.update.UpdateStep`) scans over the optimizer steps, so the host neither dispatches nor
waits between mini-batches, and an extra epoch sends its cut, not a copy of the rows.

Which rows share an optimizer step is decided over the global rows, from the seed and the step alone, so a run
does not depend on the mesh or the number of processes; the rows of each step are then dealt to the batch shards
in equal blocks, moving rows between shards (and hosts, inside the device program) where needed.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from jax.sharding import Mesh

from jppo.core import metrics as metrics_lib
from jppo.core.experience import Experience
from jppo.engine.assemble import assemble, device_rows
from jppo.engine.config import UpdateConfig, require_engine_config
from jppo.engine.microbatch import MicroBatches, cut_micro_batches, make_micro_batches, pad_cut
from jppo.engine.objectives import loss_inputs
from jppo.engine.state import TrainState
from jppo.engine.update import UpdateStep
from jppo.parallel.hostlocal import all_rows, local_shards, max_over_processes, replicated_value, take_rows
from jppo.parallel.mesh import batch_shards


class Updated(NamedTuple):
    """What :func:`run_updates` returns: the new state, the metrics averaged over its optimizer steps, and the
    accumulated gradient of each step (``[M, ...]``, only from an ``UpdateStep(..., keep_gradient=True)``)."""

    state: TrainState
    metrics: dict[str, float]
    gradients: Any


def check_batch_sizes(
    cfg: UpdateConfig, num_sequences: int, num_shards: int, role: str, mini_batch: str | None = None
) -> None:
    """One-line errors for batch sizes of ``role`` (``actor``/``critic``) that cannot be cut evenly (raised before
    anything compiles).

    ``mini_batch`` is how the messages state the mini-batch size: by default in the engine's unit
    (``actor.ppo_mini_batch_size=64 sequences``); the trainer's validator states it as its user wrote it
    (``actor.ppo_mini_batch_size=8 (prompts) x rollout.n=8 = 64 sequences``)."""
    mini = cfg.ppo_mini_batch_size
    mini_batch = mini_batch or f"{role}.ppo_mini_batch_size={mini} sequences"
    if mini < 1 or num_sequences % mini:
        raise ValueError(f"{mini_batch} does not divide the rollout batch of {num_sequences} sequences")
    if mini % num_shards:
        raise ValueError(f"{mini_batch} does not split over {num_shards} batch shards")
    if not cfg.use_dynamic_bsz:
        per_shard = mini // num_shards
        micro = cfg.ppo_micro_batch_size
        if micro < 1 or micro > per_shard or per_shard % micro:
            problem = "must be between 1 and" if micro < 1 or micro > per_shard else "does not divide"
            raise ValueError(
                f"{role}.ppo_micro_batch_size={micro} {problem} the {per_shard} sequences per batch shard of a "
                f"mini-batch ({mini_batch} over {num_shards} shards)"
            )


def mini_batches(num_sequences: int, cfg: UpdateConfig, rng: np.random.Generator) -> list[np.ndarray]:
    """Global row indices of every mini-batch of every epoch, in the order the optimizer sees them.

    One permutation of all ``num_sequences`` rows per epoch (the identity without ``shuffle``), cut into
    consecutive blocks of ``ppo_mini_batch_size``. Nothing here knows the mesh or the processes: for a given ``rng``
    the mini-batches are the same on one device, on eight, or on several hosts (the whole-run contract).
    """
    require_engine_config(cfg)
    mini = cfg.ppo_mini_batch_size
    out = []
    for _ in range(cfg.ppo_epochs):
        order = rng.permutation(num_sequences) if cfg.shuffle else np.arange(num_sequences)
        out.extend(order[m * mini : (m + 1) * mini] for m in range(num_sequences // mini))
    return out


def shard_layout(steps: list[np.ndarray], num_shards: int) -> np.ndarray:
    """Where each row of each optimizer step goes: ``[D, M, B / D]`` global row indices, batch shard first.

    Every step's ``B`` rows are split into ``D`` consecutive blocks of ``B / D``, block d to shard d: every shard
    holds the same number of rows of every step, and no shard pads. Flattened, it is the row order of a global
    array whose shard d (a contiguous block, as :mod:`jppo.parallel.hostlocal` lays rows out) holds shard d's rows
    of every step, step after step.
    """
    stacked = np.stack(steps)  # [M, B]
    return stacked.reshape(len(steps), num_shards, -1).transpose(1, 0, 2)


def regroup(batch: Experience, order: np.ndarray, mesh: Mesh) -> Experience:
    """This process's rows of the global batch taken in ``order`` (see :func:`jppo.parallel.hostlocal.take_rows`)."""
    return take_rows(batch, order, mesh)


def micro_batches_for(batch: Experience, cfg: UpdateConfig, num_shards: int):
    if cfg.use_dynamic_bsz:
        return make_micro_batches(batch, num_shards, max_token_len=cfg.ppo_max_token_len)
    return make_micro_batches(batch, num_shards, micro_batch_size=cfg.ppo_micro_batch_size)


def step_micro_batches(
    batch: Experience, cfg: UpdateConfig, mesh: Mesh, rng: np.random.Generator
) -> list[MicroBatches]:
    """This process's micro-batches of every optimizer step of ``ppo_epochs`` passes, in order.

    ``batch`` holds this process's rows (all rows with one process). The mini-batches are drawn over the global
    rows (:func:`mini_batches`), their rows moved to balanced shards (:func:`shard_layout`, :func:`regroup`), and
    each process cuts its own shards of each into micro-batches. Of the per-token arrays, only those the role's
    loss reads (:func:`~jppo.engine.objectives.loss_inputs`) are moved and cut.
    """
    shards, owned = batch_shards(mesh), local_shards(mesh)
    num_global = batch.num_sequences * shards // len(owned)
    batch = batch.keep_per_token(loss_inputs(cfg))  # no row fields: the devices never read them
    steps = mini_batches(num_global, cfg, rng)
    layout = shard_layout(steps, shards)  # [D, M, B / D]
    mine = regroup(batch, layout.reshape(-1), mesh)  # this process's shards' rows, [D_local * M * B / D]
    local = np.arange(len(owned) * layout.shape[1] * layout.shape[2]).reshape(len(owned), *layout.shape[1:])
    return [micro_batches_for(mine.take(local[:, i].reshape(-1)), cfg, len(owned)) for i in range(len(steps))]


def stacked_step_cut(
    lengths: np.ndarray, cfg: UpdateConfig, mesh: Mesh, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """The cut of every optimizer step of ``ppo_epochs`` passes, as :func:`step_micro_batches` makes it, without its
    arrays, stacked: ``row_ids`` and ``offsets`` ``[M, K, D_local, S]`` of this process's shards (see
    :func:`jppo.engine.microbatch.cut_micro_batches`), whose slots name GLOBAL rows. ``lengths``: every global row's
    real length (:func:`global_lengths`). K and S are padded to their largest over the steps and the processes."""
    shards, owned = batch_shards(mesh), local_shards(mesh)
    steps = mini_batches(len(lengths), cfg, rng)
    layout = shard_layout(steps, shards)[owned.start : owned.stop]  # [D_local, M, B / D] global rows
    sizes = dict(max_token_len=cfg.ppo_max_token_len) if cfg.use_dynamic_bsz else dict(
        micro_batch_size=cfg.ppo_micro_batch_size)
    cuts = []
    for i in range(len(steps)):
        rows = layout[:, i].reshape(-1)
        row_ids, offsets = cut_micro_batches(lengths[rows], len(owned), **sizes)
        cuts.append((np.where(row_ids >= 0, rows[np.maximum(row_ids, 0)], -1).astype(np.int32), offsets))
    k, s = max_over_processes([max(p[0].shape[0] for p in cuts), max(p[0].shape[2] for p in cuts)])
    padded = [pad_cut(row_ids, offsets, int(k), int(s)) for row_ids, offsets in cuts]
    return np.stack([row_ids for row_ids, _ in padded]), np.stack([offsets for _, offsets in padded])


def global_lengths(batch: Experience, mesh: Mesh) -> np.ndarray:
    """The real length of every global row (prompt + existing response tokens), from each process's own rows."""
    return all_rows(np.asarray(batch.lengths(), np.int32), mesh)


def run_updates(
    step: UpdateStep,
    state: TrainState,
    batch: Experience,
    cfg: UpdateConfig,
    mesh: Mesh,
    rng: np.random.Generator,
) -> Updated:
    """``ppo_epochs`` passes of mini-batch updates in one compiled call; metrics averaged over the applied optimizer
    steps (:func:`summarize_steps`). ``cfg`` is ``step``'s config (C included), or one that cuts differently.

    The rows cross to the devices once, with only the per-token fields the role's loss reads
    (:func:`~jppo.engine.objectives.loss_inputs`); the micro-batches of every step of every epoch are then
    assembled on the devices from the host's cut (:func:`stacked_step_cut`, :func:`jppo.engine.assemble.assemble`):
    the same arrays :func:`step_micro_batches` would build and send, so the update is the same, while an extra epoch
    sends only its cut."""
    rows = device_rows(batch, loss_inputs(cfg), mesh)
    lengths = global_lengths(batch, mesh)
    cut = stacked_step_cut(lengths, cfg, mesh, rng)
    if getattr(cfg, "old_log_prob", None) == "update" and cut[0].shape[0] != 1:  # a second step would be off-policy
        raise ValueError(
            f"old_log_prob='update' takes one optimizer step, but the batch of {len(lengths)} sequences makes "
            f"{cut[0].shape[0]} (mini-batch {cfg.ppo_mini_batch_size}, {cfg.ppo_epochs} epochs)"
        )
    micro = assemble(rows, cut, mesh, cfg.ppo_max_token_len if cfg.use_dynamic_bsz else None)
    state, per_step, gradients = step(state, micro)
    per_step = {name: replicated_value(values) for name, values in per_step.items()}
    host = [{name: float(values[i]) for name, values in per_step.items()} for i in range(cut[0].shape[0])]
    return Updated(state, summarize_steps(host), gradients)


def summarize_steps(steps: list[dict[str, float]]) -> dict[str, float]:
    """Metrics of one ``run_updates`` call: means over its optimizer steps (max/min by name), leaving out steps whose
    update was skipped as non-finite (their losses are NaN by nature), which ``*/skipped_updates`` counts."""
    skip_keys = [name for name in steps[0] if name.endswith("/skipped_updates")]
    applied = [step for step in steps if not any(step[key] for key in skip_keys)]
    out = metrics_lib.mean_over_steps(applied or steps)
    for key in skip_keys:
        out[key] = float(sum(step[key] for step in steps))
    return out
