"""``python -m jppo.audit --config CFG [key.sub=value ...]``: does this configuration keep the contract?

Builds the configured model(s) and one mini-batch (the configured prompts, ragged random responses, an empty
response among them), then computes the actor's (and critic's) whole-mini-batch gradient under many cuts: fixed
micro-batches of several sizes, token-budget packing, and every mesh shape the local devices allow. Each is
compared with the reference (one device, one micro-batch) and printed as a relative difference
``||g - g_ref|| / ||g_ref||``, with the largest relative difference of the loss metrics. The last line reads
``max_rel_grad_diff=<value>``; the exit status is 0 when every cut is within tolerance (1e-5 in float32), 1
otherwise. A legacy ``normalization=per_micro_batch`` config shows its split-dependence here instead of hiding it.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jppo import components
from jppo.config import ConfigError, TrainConfig, check_mesh, engine_update_config, load_config
from jppo.engine.layout import place
from jppo.engine.update import actor_loss_fn, critic_loss_fn, summed_gradient
from jppo.mesh import batch_shards, make_mesh
from jppo.microbatch import SequenceBatch, make_micro_batches
from jppo.models import CheckpointError, param_shardings

TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 5e-3}


def mesh_shapes(num_devices: int, rows: int) -> list[tuple[int, int, int]]:
    """Every (data, fsdp, tensor) with product ``num_devices`` whose batch shards divide ``rows``."""
    shapes = []
    for data, fsdp in itertools.product(range(1, num_devices + 1), repeat=2):
        if num_devices % (data * fsdp) == 0 and rows % (data * fsdp) == 0:
            shapes.append((data, fsdp, num_devices // (data * fsdp)))
    return shapes


def audit_batch(cfg: TrainConfig, inputs: components.RunInputs, rows: int, seed: int = 0) -> SequenceBatch:
    """``rows`` sequences: configured prompts, random responses of random lengths (one empty), random
    advantages, old/ref log-probs, values and returns (what the losses need; their values do not matter here)."""
    rng = np.random.default_rng(seed)
    prompts = inputs.train_data.batch_at(0, rows, cfg.trainer.seed)[1]
    width = max(len(p) for p in prompts)
    prompt_ids = np.zeros((rows, width), np.int32)
    prompt_mask = np.zeros((rows, width), bool)
    for i, p in enumerate(prompts):
        prompt_ids[i, width - len(p):] = p
        prompt_mask[i, width - len(p):] = True
    length = cfg.rollout.max_response_length
    lengths = rng.integers(1, length + 1, rows)
    lengths[rows // 2] = 0
    attention = np.arange(length)[None, :] < lengths[:, None]
    vocab = inputs.tokenizer.vocab_size
    response_ids = np.where(attention, rng.integers(0, vocab, (rows, length)), 0).astype(np.int32)
    noise = lambda scale: np.where(attention, rng.normal(scale=scale, size=(rows, length)), 0.0).astype(np.float32)
    per_token = {
        "old_log_prob": noise(0.3) - 2.5, "ref_log_prob": noise(0.3) - 2.5, "advantages": noise(1.0),
        "values": noise(1.0), "returns": noise(1.0),
    }
    return SequenceBatch(prompt_ids, prompt_mask, response_ids, attention, attention, per_token)


def cuts(batch: SequenceBatch, shards: int, every: bool) -> list[tuple[str, dict]]:
    """Fixed micro-batches and token budgets. ``every``: all of them (whole shard, halves, single sequences; a
    tight and a loose budget); otherwise the two that cut finest (single sequences, the tight budget)."""
    per_shard = batch.num_sequences // shards
    longest = int(batch.lengths().max())
    if not every:
        return [("fixed micro=1", {"micro_batch_size": 1}), (f"tokens<={longest}", {"max_token_len": longest})]
    sizes = sorted({per_shard, per_shard // 2 if per_shard % 2 == 0 else per_shard, 1}, reverse=True)
    out = [(f"fixed micro={m}", {"micro_batch_size": m}) for m in sizes]
    return out + [(f"tokens<={budget}", {"max_token_len": budget}) for budget in sorted({longest, 2 * longest})]


def flat(tree) -> np.ndarray:
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])


class Role:
    """One model under audit: its parameters and how to take its gradient on any mesh."""

    def __init__(self, name: str, graphdef: nnx.GraphDef, params: nnx.State, loss, update_cfg):
        self.name, self.graphdef, self.params, self.loss, self.cfg = name, graphdef, params, loss, update_cfg

    def gradient(self, mesh, batch: SequenceBatch, cut: dict, loss_scale_factor: float):
        micro = make_micro_batches(batch, batch_shards(mesh), **cut)
        params = jax.device_put(self.params, param_shardings(self.params, mesh))
        fn = jax.jit(summed_gradient(self.graphdef, self.loss, self.cfg, mesh), static_argnums=(2,))
        with jax.set_mesh(mesh):
            grads, metrics = fn(params, place(micro.device_arrays(), mesh), loss_scale_factor)
        return flat(grads), {k: float(v) for k, v in jax.device_get(metrics).items()}, micro.num_micro_batches


def build_roles(cfg: TrainConfig, inputs: components.RunInputs) -> list[Role]:
    cpu = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    policy = components.build_policy(cfg, inputs.tokenizer, cpu)
    graphdef, params = nnx.split(policy, nnx.Param)
    actor_cfg = engine_update_config(cfg, "actor")
    roles = [Role("actor", graphdef, params, actor_loss_fn(actor_cfg, cfg.rollout.temperature), actor_cfg)]
    if cfg.use_critic:
        critic = components.build_critic(cfg, policy, cpu)
        critic_graphdef, critic_params = nnx.split(critic, nnx.Param)
        critic_cfg = engine_update_config(cfg, "critic")
        roles.append(Role("critic", critic_graphdef, critic_params, critic_loss_fn(critic_cfg), critic_cfg))
    return roles


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def audit(cfg: TrainConfig, inputs: components.RunInputs, quick: bool = False, out=None) -> float:
    """Prints the table; returns the largest relative gradient difference. Every cut runs on one device; each
    mesh of all devices runs the finest cuts (``quick``: only the pure data-parallel mesh and a 3-D one)."""
    out = sys.stdout if out is None else out
    devices = jax.device_count()
    rows = cfg.actor.ppo_mini_batch_size * cfg.rollout.n
    batch = audit_batch(cfg, inputs, rows)
    reference_mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    worst = 0.0
    print(f"jppo.audit: {rows} sequences per mini-batch, {int(batch.response_mask.sum())} loss tokens, "
          f"{devices} devices, normalization actor={cfg.actor.normalization} critic={cfg.critic.normalization}", file=out)
    header = f"{'model':<7} {'mesh (d,f,t)':<13} {'cut':<16} {'K':>3} {'rel grad diff':>14} {'rel metric diff':>16}"
    print(header, file=out)
    print("-" * len(header), file=out)
    for role in build_roles(cfg, inputs):
        scale = role.cfg.loss_scale_factor
        ref_grad, ref_metrics, _ = role.gradient(reference_mesh, batch, {"micro_batch_size": rows}, scale)
        ref_norm = max(float(np.linalg.norm(ref_grad)), 1e-30)
        meshes = [(1, 1, 1)] + [shape for shape in mesh_shapes(devices, rows) if shape != (1, 1, 1)]
        if quick:
            meshes = [shape for shape in meshes if shape in {(1, 1, 1), (devices, 1, 1), (2, 2, devices // 4)}]
        for shape in meshes:
            mesh = make_mesh(*shape, devices=jax.devices()[: int(np.prod(shape))])
            for label, cut in cuts(batch, batch_shards(mesh), every=shape == (1, 1, 1)):
                grad, metrics, k = role.gradient(mesh, batch, cut, scale)
                diff = float(np.linalg.norm(grad - ref_grad)) / ref_norm
                metric_diff = max(
                    (relative(metrics[name], ref_metrics[name]) for name in ref_metrics if name.endswith("_loss")),
                    default=0.0,
                )
                worst = max(worst, diff)
                print(f"{role.name:<7} {str(shape):<13} {label:<16} {k:>3} {diff:>14.3e} {metric_diff:>16.3e}", file=out)
    return worst


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jppo.audit", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="YAML config (default: the embedded quickstart defaults)")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    parser.add_argument("--quick", action="store_true", help="fewer meshes: data-parallel and one 3-D mesh")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        check_mesh(cfg, jax.device_count())
        inputs = components.load_inputs(dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, val_every=0)))
    except (ConfigError, CheckpointError, ValueError, KeyError, FileNotFoundError) as error:
        print(f"jppo.audit: error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    worst = audit(cfg, inputs, quick=args.quick)
    tolerance = TOLERANCE.get(cfg.model.dtype, 1e-5)
    verdict = "within" if worst <= tolerance else "OUTSIDE"
    print(f"jppo.audit: {verdict} tolerance {tolerance:g} ({time.perf_counter() - started:.0f} s)")
    print(f"max_rel_grad_diff={worst:.3e}")
    return 0 if worst <= tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
