"""How the sampler batches: continuous batching on a long-tailed workload, and one shared prompt block per prompt.

    python -m bench.batching [--quick] [--repeats N]

**Continuous batching.** A random ``CausalLM`` at a small init samples near-uniformly from its vocabulary, so
with ``k`` of its ``V`` tokens as EOS each step ends a row with probability ``k / V``: response lengths are
geometric with mean ``V / k``, capped at ``max_new_tokens`` (the workload below: mean 128, cap 512, so a few
percent of the rows run to the cap while most end far earlier, the long tail of a reasoning task's lengths). The
same prompts and key are decoded with every row at once (``max_num_seqs = 0``) and with ``max_num_seqs`` slots
refilled as rows end. Each row's tokens are the same both ways (checked). Reported per mode: the fraction of
decoding row-steps that produced a token (``RolloutBatch.decode_slots``), and tokens/s.

**Shared prompt block.** At a long-prompt shape (2,048-token prompts, 256-token responses, ``n = 8``), the sampler
keeps each prompt's keys and values once for its ``n`` samples; the comparison is the same rows with each
prompt copied ``n`` times (``n = 1`` over the repeated prompts: one prompt block per row, the layout of a
sampler that copies the prompt's cache per sample). Both produce the same tokens (rows keep their indices, hence
their keys; checked). Reported: the bytes of the caches (prompt block + response block, from the arrays' shapes),
XLA's temporary bytes of each compiled program, and seconds per rollout.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench.report import command
from bench.timing import time_side_by_side
from jppo.models import CausalLM, ModelConfig, create_model
from jppo.rollout import SamplingParams, make_generate_fn, pad_prompts

LONG_TAIL = {
    "full": dict(prompts=64, n=8, max_num_seqs=32, max_new=512, mean_length=128, vocab=512, hidden=64, layers=2),
    "quick": dict(prompts=8, n=4, max_num_seqs=4, max_new=48, mean_length=12, vocab=96, hidden=32, layers=1),
}
LONG_PROMPT = {
    "full": dict(prompts=2, n=8, prompt=2048, max_new=256, vocab=512, hidden=256, layers=4, heads=4),
    "quick": dict(prompts=2, n=4, prompt=64, max_new=16, vocab=96, hidden=32, layers=1, heads=2),
}


def model_for(vocab: int, hidden: int, layers: int, heads: int = 4) -> CausalLM:
    config = ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_layers=layers,
                         num_heads=heads, model_type="qwen2", initializer_range=0.02)
    return create_model(CausalLM, config, seed=0)


def random_prompts(count: int, low: int, high: int, vocab: int, eos: tuple[int, ...], seed: int = 0):
    rng = np.random.default_rng(seed)
    allowed = np.setdiff1d(np.arange(1, vocab), eos)
    return [rng.choice(allowed, size=int(rng.integers(low, high + 1))).tolist() for _ in range(count)]


def useful_fraction(out) -> float:
    """Generated tokens after each row's first (one decoding forward each) over the row-steps decoded."""
    lengths = np.asarray(out.response_mask).sum(axis=1)
    return float(np.maximum(lengths - 1, 0).sum() / max(int(np.sum(out.decode_slots)), 1))


def continuous_batching(quick: bool, repeats: int) -> dict:
    size = LONG_TAIL["quick" if quick else "full"]
    vocab, mean = size["vocab"], size["mean_length"]
    eos = tuple(range(vocab - vocab // mean, vocab))  # k = V / mean EOS ids: a hazard of 1 / mean per step
    model = model_for(vocab, size["hidden"], size["layers"])
    graphdef, state = nnx.split(model)
    prompts = random_prompts(size["prompts"], 16, 48, vocab, eos)
    ids, mask = pad_prompts(prompts, pad_id=0, multiple=16)
    ids, mask = jnp.asarray(ids), jnp.asarray(mask)
    base = SamplingParams(max_new_tokens=size["max_new"], temperature=1.0, n=size["n"], eos_token_ids=eos)
    modes = {"all_rows": base, "continuous": dataclasses.replace(base, max_num_seqs=size["max_num_seqs"])}
    key = jax.random.key(0)
    outputs = {}

    def runner(name):
        fn = make_generate_fn(graphdef, modes[name])

        def run():
            outputs[name] = jax.block_until_ready(fn(state, ids, mask, key))

        return run

    timings = time_side_by_side({name: runner(name) for name in modes}, repeats)
    lengths = np.asarray(outputs["all_rows"].response_mask).sum(axis=1)
    tokens = int(lengths.sum())
    result = {
        "workload": {
            "rows": len(prompts) * size["n"], "prompts": len(prompts), "n": size["n"], "prompt_tokens": "16-48",
            "length_distribution": f"geometric, mean {mean} (EOS hazard {len(eos)}/{vocab} per step), capped at "
            f"{size['max_new']}",
            "measured_lengths": {"mean": float(lengths.mean()), "median": float(np.median(lengths)),
                                 "p90": float(np.percentile(lengths, 90)), "max": int(lengths.max()),
                                 "at_cap": float((lengths == size["max_new"]).mean())},
            "model": {"hidden_size": size["hidden"], "num_layers": size["layers"], "vocab_size": vocab},
            "max_num_seqs": size["max_num_seqs"],
        },
        "same_tokens": bool(all(np.array_equal(np.asarray(getattr(outputs["continuous"], f)),
                                               np.asarray(getattr(outputs["all_rows"], f)))
                                for f in ("response_ids", "response_mask"))),
    }
    for name, timing in timings.items():
        result[name] = timing.to_dict() | {
            "useful_slot_fraction": useful_fraction(outputs[name]),
            "decode_slots": int(np.sum(outputs[name].decode_slots)),
            "tokens_per_s": tokens / timing.median_s,
        }
    result["rollout_useful_slot_fraction"] = result["continuous"]["useful_slot_fraction"]
    result["rollout_continuous_vs_all_rows"] = result["continuous"]["tokens_per_s"] / result["all_rows"]["tokens_per_s"]
    return result


def tree_bytes(tree) -> int:
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def shared_prefix(quick: bool, repeats: int) -> dict:
    size = LONG_PROMPT["quick" if quick else "full"]
    n, vocab = size["n"], size["vocab"]
    model = model_for(vocab, size["hidden"], size["layers"], size["heads"])
    graphdef, state = nnx.split(model)
    prompts = random_prompts(size["prompts"], size["prompt"], size["prompt"], vocab, ())
    ids, mask = pad_prompts(prompts, pad_id=0, multiple=size["prompt"])
    inputs = {"one_block": (jnp.asarray(ids), jnp.asarray(mask), n),
              "block_per_sample": (jnp.asarray(np.repeat(ids, n, axis=0)), jnp.asarray(np.repeat(mask, n, axis=0)), 1)}
    key = jax.random.key(0)
    outputs, result = {}, {}

    def caches(prompt_ids, samples):
        """The sampler's two caches for these prompts (shapes only)."""

        def build():
            lm = nnx.merge(graphdef, state)
            zeros = jnp.zeros(prompt_ids.shape, jnp.int32)
            _, prompt = lm.prefill(zeros, zeros, zeros)
            return prompt, lm.init_response_cache(prompt_ids.shape[0] * samples, size["max_new"])

        return jax.eval_shape(build)

    def runner(name):
        prompt_ids, prompt_mask, samples = inputs[name]
        # no EOS: every row decodes all max_new tokens, so both do the same work
        fn = make_generate_fn(graphdef, SamplingParams(max_new_tokens=size["max_new"], n=samples))
        compiled = fn.lower(state, prompt_ids, prompt_mask, key).compile()
        prompt_cache, response_cache = caches(prompt_ids, samples)
        result[name] = {"prompt_cache_bytes": tree_bytes(prompt_cache),
                        "response_cache_bytes": tree_bytes(response_cache),
                        "xla_temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes)}
        result[name]["cache_bytes"] = result[name]["prompt_cache_bytes"] + result[name]["response_cache_bytes"]

        def run():
            outputs[name] = jax.block_until_ready(compiled(state, prompt_ids, prompt_mask, key))

        return run

    timings = time_side_by_side({name: runner(name) for name in inputs}, repeats)
    for name, timing in timings.items():
        result[name] |= timing.to_dict()
    one_block, per_sample = outputs["one_block"], outputs["block_per_sample"]
    result["same_tokens"] = bool(np.array_equal(np.asarray(one_block.response_ids),
                                                np.asarray(per_sample.response_ids)))
    result["shape"] = {key: size[key] for key in ("prompts", "n", "prompt", "max_new", "hidden", "layers", "vocab")}
    one, each = result["one_block"], result["block_per_sample"]
    result["rollout_shared_prefix_memory_ratio"] = one["cache_bytes"] / each["cache_bytes"]
    result["xla_temp_ratio"] = one["xla_temp_bytes"] / each["xla_temp_bytes"]
    result["speedup"] = each["median_s"] / one["median_s"]
    return result


def measure(quick: bool, repeats: int) -> dict:
    return {"continuous_batching": continuous_batching(quick, repeats), "shared_prefix": shared_prefix(quick, repeats)}


if __name__ == "__main__":
    command("batching", __doc__, measure, repeats=3)
