"""The sampler/trainer mismatch of a model with experts, with and without routing replay.

    python -m bench.numbers.routing_replay [--prompts 64] [--dtypes bfloat16,float32] [--json PATH] [key=value ...]

On ``configs/quickstart_moe.yaml`` (overrides after the flags, e.g. ``model.path=DIR`` for a trained policy; by
default the config's random initial policy), the sampler draws ``rollout.n`` responses to ``--prompts`` training
prompts computing in each of ``--dtypes`` (``rollout.dtype``, its routing recorded), and the trainer recomputes the
old log-probs of the sampled tokens in float32, once routing each token itself and once replaying the sampler's
experts (``actor.routing_replay: rollout``). Over the response tokens (the loss mask), with ``d = old - rollout``:

- ``mean |d|``, ``max |d|``;
- ``kl``: ``mean(-d)``, the k1 estimate of KL(rollout || trainer) that a run logs as ``rollout_corr/kl``;
- ``k3``: the k3 estimate of the same, ``mean(exp(d) - 1 - d)`` (never negative);
- ``outside``: the fraction of tokens whose ratio ``exp(d)`` falls outside [0.9, 1.1];

and ``after flip``: ``mean |d|`` over the response tokens predicted at or after their row's first token whose
routing differs (where a flip can reach the log-prob); and the routing: the fraction of (token, layer with experts)
choices, over every real token the sampler recorded (prompt and response), where the trainer's own top-k set
differs from the sampler's, and the fraction of response tokens with a differing choice in at least one layer.
Nothing is timed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import numpy as np
from flax import nnx

from jppo.config import load_config, views
from jppo.engine import forward_batch, log_prob_fn
from jppo.models.moe import collect_routing, not_recorded
from jppo.parallel.mesh import make_mesh
from jppo.rollout import Sampler
from jppo.run import build

CONFIG = "configs/quickstart_moe.yaml"


def own_routing(graphdef: nnx.GraphDef, state: nnx.State, exp) -> np.ndarray:
    """The trainer's own experts ``[N, P + L, Ls, k]`` of every token (one float32 forward pass)."""
    ids = np.concatenate([exp.prompt_ids, exp.response_ids], axis=1)
    segments = np.concatenate([exp.prompt_mask, exp.response_attention], axis=1).astype(np.int32)
    positions = np.maximum(np.cumsum(segments, axis=1) - 1, 0)

    @jax.jit
    def experts(state, ids, positions, segments):
        with collect_routing() as routed:
            nnx.merge(graphdef, state).hidden_states(ids, positions, segments)
        return routed[0]

    return np.moveaxis(np.asarray(experts(state, ids, positions, segments)), 0, 2)


def mismatch(old: np.ndarray, rollout: np.ndarray, mask: np.ndarray) -> dict[str, float]:
    d = (old - rollout)[mask].astype(np.float64)
    ratio = np.exp(d)
    return {"mean_abs": float(np.abs(d).mean()), "max_abs": float(np.abs(d).max()),
            "kl": float(np.mean(-d)), "k3": float(np.mean(ratio - 1 - d)),
            "outside": float(np.mean((ratio < 0.9) | (ratio > 1.1)))}


def measure(overrides: list[str], prompts: int, dtype: str) -> dict:
    cfg = load_config(CONFIG, [*overrides, f"rollout.dtype={dtype}", "actor.routing_replay=rollout"])
    inputs = build.load_inputs(cfg)
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    policy = build.build_policy(cfg, inputs.tokenizer, mesh)
    graphdef, state = nnx.split(policy, nnx.Param)
    sampler = Sampler(build.sampling_graphdef(cfg, policy), inputs.tokenizer.pad_id, mesh,
                      views.sampling_params(cfg, inputs.tokenizer), cfg.rollout.prompt_bucket)
    _, batch, _ = inputs.train_data.batch_at(0, prompts, cfg.trainer.seed)
    exp = sampler(state, batch, jax.random.key(cfg.trainer.seed))
    mask = exp.response_mask.astype(bool)
    recorded = exp.routed_experts
    own = own_routing(graphdef, state, exp)
    real = np.concatenate([exp.prompt_mask, exp.response_attention], axis=1).astype(bool)
    counted = real[:, :, None] & (recorded[..., 0] != not_recorded(policy.config.num_experts))
    differs = np.any(np.sort(own, axis=-1) != np.sort(recorded, axis=-1), axis=-1) & counted  # [N, P + L, Ls]
    p, length = exp.prompt_ids.shape[1], exp.response_ids.shape[1]
    flipped = differs.any(-1)
    first = np.where(flipped.any(1), np.argmax(flipped, axis=1), p + length)
    reached = mask & (p - 1 + np.arange(length)[None, :] >= first[:, None])  # response token j: at column P - 1 + j
    log_probs = log_prob_fn(graphdef, temperature=cfg.rollout.temperature, chunk_size=cfg.actor.log_prob_chunk_size)
    out = {"sampler_dtype": dtype, "response_tokens": int(mask.sum())}
    for name, batch_rows in (("own", dataclasses.replace(exp, routed_experts=None)), ("replay", exp)):
        old = forward_batch(log_probs, state, batch_rows, mesh, micro_batch_size=cfg.actor.ppo_micro_batch_size)
        out[name] = mismatch(old, exp.rollout_log_prob, mask)
        out[name]["after_flip"] = float(np.abs(old - exp.rollout_log_prob)[reached].mean()) if reached.any() else 0.0
    out["tokens_after_flip"] = int(reached.sum())
    out["routing_choices_differ"] = float(differs[counted].mean())
    out["response_tokens_with_a_differing_layer"] = float(flipped[:, p:][mask].mean())
    return out


def table(results: list[dict]) -> str:
    lines = ["| sampler | trainer routing | mean abs dlogp | max abs dlogp | rollout_corr/kl | k3 KL | "
             "ratio outside [0.9, 1.1] | mean abs dlogp after a flip |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        for name, label in (("own", "its own"), ("replay", "replayed")):
            m = r[name]
            lines.append(f"| {r['sampler_dtype']} | {label} | {m['mean_abs']:.3g} | {m['max_abs']:.3g} | "
                         f"{m['kl']:.3g} | {m['k3']:.3g} | {m['outside']:.3g} | {m['after_flip']:.3g} |")
    lines.append("")
    for r in results:
        lines.append(f"{r['sampler_dtype']} sampler: {r['response_tokens']} response tokens "
                     f"({r['tokens_after_flip']} after a flip); routing choices that "
                     f"differ {r['routing_choices_differ']:.3g} of (token, layer) pairs, response tokens with a "
                     f"differing layer {r['response_tokens_with_a_differing_layer']:.3g}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--json", default=None, help="also write the results there")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    results = [measure(args.overrides, args.prompts, dtype) for dtype in args.dtypes.split(",")]
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
