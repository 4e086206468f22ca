"""From a rollout batch to optimizer steps: epochs, shuffled mini-batches, micro-batches, metrics.

Host-side orchestration only; everything per token runs inside the jitted :class:`~jppo.engine.update.UpdateStep`.
All mini-batches of all epochs are cut on the host first, stacked, and run by ONE compiled call that scans over
the optimizer steps, so the host neither dispatches nor waits between mini-batches.
"""

from __future__ import annotations

import numpy as np
from jax.sharding import Mesh

from jppo import metrics as M
from jppo.engine.config import UpdateConfig
from jppo.engine.layout import place
from jppo.engine.update import TrainState, UpdateStep
from jppo.hostlocal import local_shards, max_over_processes, replicated_value
from jppo.mesh import batch_shards
from jppo.microbatch import SequenceBatch, make_micro_batches, stack_micro_batches


def check_batch_sizes(cfg: UpdateConfig, num_sequences: int, num_shards: int, section: str) -> None:
    """One-line errors for batch sizes that cannot be cut evenly (raised before anything compiles)."""
    mini = cfg.ppo_mini_batch_size
    if mini < 1 or num_sequences % mini:
        raise ValueError(
            f"{section}.ppo_mini_batch_size={mini} sequences does not divide the rollout batch of {num_sequences}"
        )
    if mini % num_shards:
        raise ValueError(f"{section}.ppo_mini_batch_size={mini} sequences does not split over {num_shards} batch shards")
    if not cfg.use_dynamic_bsz:
        per_shard = mini // num_shards
        micro = cfg.ppo_micro_batch_size
        if micro < 1 or micro > per_shard:
            raise ValueError(
                f"{section}.ppo_micro_batch_size={micro} must be between 1 and the {per_shard} sequences per shard of "
                f"a mini-batch ({section}.ppo_mini_batch_size={mini} over {num_shards} shards)"
            )
        if per_shard % micro:
            raise ValueError(
                f"{section}.ppo_micro_batch_size={micro} does not divide the {per_shard} sequences per shard of a "
                f"mini-batch ({section}.ppo_mini_batch_size={mini} over {num_shards} shards)"
            )


def mini_batches(num_sequences: int, num_shards: int, cfg: UpdateConfig, rng: np.random.Generator) -> list[np.ndarray]:
    """Row indices of every mini-batch of every epoch, in the order the optimizer sees them.

    Rows never leave their batch shard (shard d holds rows ``[d N/D, (d+1) N/D)``): each epoch shuffles every
    shard's rows on its own, and mini-batch m takes the m-th block of each shard. The same mini-batches therefore
    come out whether one process holds the whole batch or every process only its own shards, and no row crosses
    devices between the rollout and the update.
    """
    per_shard = num_sequences // num_shards
    per_step = cfg.ppo_mini_batch_size // num_shards
    shards = np.arange(num_sequences).reshape(num_shards, per_shard)
    out = []
    for _ in range(cfg.ppo_epochs):
        order = np.stack([rng.permutation(per_shard) if cfg.shuffle else np.arange(per_shard) for _ in shards])
        shuffled = np.take_along_axis(shards, order, axis=1)
        out.extend(shuffled[:, m * per_step : (m + 1) * per_step].reshape(-1) for m in range(per_shard // per_step))
    return out


def micro_batches_for(batch: SequenceBatch, cfg: UpdateConfig, num_shards: int):
    if cfg.use_dynamic_bsz:
        return make_micro_batches(batch, num_shards, max_token_len=cfg.ppo_max_token_len)
    return make_micro_batches(batch, num_shards, micro_batch_size=cfg.ppo_micro_batch_size)


def run_updates(
    step: UpdateStep,
    state: TrainState,
    batch: SequenceBatch,
    cfg: UpdateConfig,
    mesh: Mesh,
    rng: np.random.Generator,
    loss_scale_factor: float,
) -> tuple[TrainState, dict[str, float]]:
    """``ppo_epochs`` passes of mini-batch updates in one call; metrics averaged over optimizer steps.

    ``batch`` holds this process's rows (all rows with one process). Every process draws the same global
    mini-batches and cuts its own rows of each; the micro-batch counts are agreed across processes.
    """
    shards, owned = batch_shards(mesh), local_shards(mesh)
    num_global = batch.num_sequences * shards // len(owned)
    offset = owned.start * (num_global // shards)
    micro = []
    for rows in mini_batches(num_global, shards, cfg, rng):
        mine = rows[(rows >= offset) & (rows < offset + batch.num_sequences)] - offset
        micro.append(micro_batches_for(batch.take(mine), cfg, len(owned)))
    k, s = max_over_processes([max(m.input_ids.shape[0] for m in micro), max(m.row_ids.shape[2] for m in micro)])
    steps = stack_micro_batches(micro, int(k), int(s))
    state, per_step = step(state, place(steps.device_arrays(), mesh, scanned=2), loss_scale_factor)
    per_step = {name: replicated_value(values) for name, values in per_step.items()}
    host = [{name: float(values[i]) for name, values in per_step.items()} for i in range(len(micro))]
    return state, M.mean_over_steps(host)
