"""From a rollout batch to optimizer steps: epochs, shuffled mini-batches, micro-batches, metrics.

Host-side orchestration only; everything per token runs inside the jitted :class:`~jppo.engine.update.UpdateStep`.
All mini-batches of all epochs are cut on the host first, stacked, and run by ONE compiled call that scans over
the optimizer steps, so the host neither dispatches nor waits between mini-batches.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

from jppo import metrics as M
from jppo.engine.config import UpdateConfig
from jppo.engine.layout import place
from jppo.engine.update import TrainState, UpdateStep
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


def mini_batches(num_sequences: int, cfg: UpdateConfig, rng: np.random.Generator) -> list[np.ndarray]:
    """Row indices of every mini-batch of every epoch, in the order the optimizer sees them."""
    out = []
    for _ in range(cfg.ppo_epochs):
        order = rng.permutation(num_sequences) if cfg.shuffle else np.arange(num_sequences)
        out.extend(np.split(order, num_sequences // cfg.ppo_mini_batch_size))
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
    """``ppo_epochs`` passes of mini-batch updates over ``batch`` in one call; metrics averaged over optimizer steps."""
    shards = batch_shards(mesh)
    steps = stack_micro_batches(
        [micro_batches_for(batch.take(rows), cfg, shards) for rows in mini_batches(batch.num_sequences, cfg, rng)]
    )
    state, per_step = step(state, place(steps.device_arrays(), mesh, scanned=2), loss_scale_factor)
    per_step = jax.device_get(per_step)
    count = steps.input_ids.shape[0]
    host = [{name: float(values[i]) for name, values in per_step.items()} for i in range(count)]
    return state, M.mean_over_steps(host)
