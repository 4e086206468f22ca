"""What the mesh-independent mini-batches cost: cutting a rollout batch into the optimizer steps' micro-batches.

    python -m bench.row_movement [--quick] [--devices 8] [--repeats 5]

Since the whole-run contract (``CONTRACT.md`` section 8), which rows share an optimizer step is drawn over the
global batch, and each step's rows are dealt to the batch shards in equal blocks, so rows move between shards.
Measured side by side in this process, on ``--devices`` simulated CPU devices, at a GSM8K-like rollout batch:

- ``per_shard_cut``: the cut before it (each shard shuffled its own rows, mini-batch m took the m-th block of every
  shard: no row moved, but the mini-batches depended on the number of shards), reproduced here as the baseline;
- ``global_cut``: :func:`jppo.engine.step_micro_batches` in one process (the rows are all on the host: one numpy take);
- ``device_row_move``: the row movement alone as several processes do it (:func:`jppo.parallel.hostlocal.take_rows` through
  the devices: host -> global arrays -> one jitted gather -> this process's rows back on the host);
- ``actor_update``: the actor's compiled update of the same batch (every mini-batch of every epoch), for scale.

Ratios printed: ``global_cut / per_shard_cut`` and each of the cuts and the row movement over ``actor_update``.
"""

from __future__ import annotations

import argparse
import json
import sys


def per_shard_steps(num_sequences, num_shards, cfg, rng):
    """The mini-batch rows of the cut before the whole-run contract (the baseline; rows never left their shard)."""
    import numpy as np

    per_shard, per_step = num_sequences // num_shards, cfg.ppo_mini_batch_size // num_shards
    shards = np.arange(num_sequences).reshape(num_shards, per_shard)
    out = []
    for _ in range(cfg.ppo_epochs):
        order = np.stack([rng.permutation(per_shard) for _ in shards])
        shuffled = np.take_along_axis(shards, order, axis=1)
        out.extend(shuffled[:, m * per_step : (m + 1) * per_step].reshape(-1) for m in range(per_shard // per_step))
    return out


SIZES = {
    # rows, prompt and response widths, mini-batch (sequences), epochs, model width and depth
    "full": dict(rows=256, prompt=128, response=256, mini=64, epochs=2, hidden=128, layers=2),
    "quick": dict(rows=32, prompt=8, response=8, mini=8, epochs=2, hidden=32, layers=1),
}


def measure(quick: bool, repeats: int) -> dict:
    import jax
    import numpy as np
    from flax import nnx

    from bench.timing import time_side_by_side
    from jppo.engine import ActorConfig, UpdateStep, actor_loss_fn, init_train_state, step_micro_batches
    from jppo.engine.driver import micro_batches_for, mini_batches, shard_layout
    from jppo.parallel.hostlocal import take_rows
    from jppo.parallel.mesh import batch_shards, make_mesh
    from jppo.engine.layout import place
    from jppo.core.experience import Experience
    from jppo.engine.microbatch import stack_micro_batches
    from jppo.models import CausalLM, ModelConfig, create_model

    size = SIZES["quick" if quick else "full"]
    mesh = make_mesh(-1, 1, 1)
    shards = batch_shards(mesh)
    n, p, length = size["rows"], size["prompt"], size["response"]
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, length + 1, n)
    attention = np.arange(length)[None, :] < lengths[:, None]
    noise = lambda: np.where(attention, rng.normal(size=(n, length)), 0).astype(np.float32)  # noqa: E731
    vocab = 1024
    batch = Experience(
        prompt_ids=rng.integers(1, vocab, (n, p)).astype(np.int32), prompt_mask=np.ones((n, p), bool),
        response_ids=np.where(attention, rng.integers(1, vocab, (n, length)), 0).astype(np.int32),
        response_mask=attention,
        **{name: noise() for name in ("old_log_prob", "ref_log_prob", "advantages", "returns", "values",
                                      "rollout_log_prob")},
    )
    cfg = ActorConfig(ppo_mini_batch_size=size["mini"], ppo_micro_batch_size=max(size["mini"] // shards // 2, 1),
                      ppo_epochs=size["epochs"], log_prob_chunk_size=64, loss_scale_factor=float(length))

    def per_shard_cut():
        steps = per_shard_steps(n, shards, cfg, np.random.default_rng([0, 1]))
        return [micro_batches_for(batch.take(rows), cfg, shards) for rows in steps]

    def global_cut():
        return step_micro_batches(batch, cfg, mesh, np.random.default_rng([0, 1]))

    order = shard_layout(mini_batches(n, cfg, np.random.default_rng([0, 1])), shards).reshape(-1)

    def device_row_move():
        return take_rows(batch, order, mesh, through_devices=True)

    model_cfg = ModelConfig(vocab_size=vocab, hidden_size=size["hidden"], intermediate_size=2 * size["hidden"],
                            num_layers=size["layers"], num_heads=4, num_kv_heads=2)
    graphdef, params = nnx.split(create_model(CausalLM, model_cfg, mesh), nnx.Param)
    update = UpdateStep(graphdef, actor_loss_fn(cfg), cfg, mesh, "actor")
    arrays = place(stack_micro_batches(global_cut()).device_arrays(), mesh, scanned=2)
    state = {"s": init_train_state(params, cfg, mesh)}

    def actor_update():
        state["s"], metrics, _ = update(state["s"], arrays)
        jax.block_until_ready(metrics)

    timings = time_side_by_side(
        {"per_shard_cut": per_shard_cut, "global_cut": global_cut, "device_row_move": device_row_move,
         "actor_update": actor_update},
        repeats,
    )
    median = {name: t.median_s for name, t in timings.items()}
    return {
        "size": size, "devices": jax.device_count(), "batch_shards": shards,
        "timings": {name: t.to_dict() for name, t in timings.items()},
        "global_vs_per_shard_cut": median["global_cut"] / median["per_shard_cut"],
        "per_shard_cut_vs_update": median["per_shard_cut"] / median["actor_update"],
        "global_cut_vs_update": median["global_cut"] / median["actor_update"],
        "device_row_move_vs_update": median["device_row_move"] / median["actor_update"],
        "moved_bytes": int(sum(a.nbytes for a in jax.tree.leaves(batch)) * cfg.ppo_epochs),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.row_movement", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run; its numbers mean nothing)")
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices (default 8)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats after the warm-up (default 5)")
    args = parser.parse_args(argv)
    if args.devices < 1 or args.repeats < 1:
        print("bench.row_movement: error: --devices and --repeats must be >= 1", file=sys.stderr)
        return 2
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)  # before any JAX operation
    result = measure(args.quick, args.repeats)
    for name, timing in result["timings"].items():
        print(f"{name:<16} median {timing['median_s'] * 1e3:9.2f} ms   (first {timing['first_s'] * 1e3:9.2f} ms)")
    for key in ("global_vs_per_shard_cut", "per_shard_cut_vs_update", "global_cut_vs_update", "device_row_move_vs_update"):
        print(f"{key} = {result[key]:.4f}")
    print(json.dumps({key: result[key] for key in ("size", "devices", "batch_shards", "moved_bytes")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
