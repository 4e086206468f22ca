"""Greedy decoding throughput: jppo's KV-cache sampler vs full recomputation vs ``transformers`` ``generate``.

    python -m bench.sampler [--quick] [--repeats N]

One tiny random Qwen2-shaped model is built with ``transformers`` (fixed torch seed), saved, and loaded into jppo
with ``jppo.models.load_pretrained``, so all three decode the same weights. The three methods:

- **KV-cache sampler**: ``jppo.rollout.make_generate_fn`` (one prefill, then one token per step from the cache);
- **full recomputation**: one jitted program that, at every step, re-runs the whole forward over a fixed
  ``prompt + max_new_tokens`` buffer (later slots are padding) and takes the argmax: what decoding costs
  without a cache, compiled once;
- **transformers**: ``Qwen2ForCausalLM.generate(do_sample=False)`` on CPU torch, left-padded batch.

Each is warmed up (compilation), then timed over several interleaved repeats; the table reports medians, torch
running with as many threads as XLA's CPU pool. Tokens/s counts ``batch * max_new_tokens`` (no EOS, so every row
runs to the end). The script also reports whether the three
produce the same greedy tokens (float32 everywhere; a random model's near-ties may flip an argmax late in a
long greedy run, which is then reported rather than hidden).
"""

from __future__ import annotations

import tempfile
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from flax import nnx

from bench.environment import match_torch_threads
from bench.report import command
from bench.rollout_shapes import saved_qwen2
from bench.timing import time_side_by_side
from jppo.models import CausalLM, load_pretrained
from jppo.rollout import SamplingParams, make_generate_fn, pad_prompts

FULL = dict(batch=8, max_prompt=48, max_new_tokens=64, hidden=128, layers=4, vocab=2048)
QUICK = dict(batch=4, max_prompt=16, max_new_tokens=16, hidden=64, layers=2, vocab=512)


def full_recompute_fn(model: CausalLM, max_new_tokens: int) -> Callable:
    """Jitted greedy decoding without a cache: a full forward over the whole buffer at every step."""
    graphdef, _ = nnx.split(model)

    @jax.jit
    def decode(state, prompt_ids, prompt_mask):
        model = nnx.merge(graphdef, state)
        batch, prompt_len = prompt_ids.shape
        ids = jnp.concatenate([prompt_ids, jnp.zeros((batch, max_new_tokens), jnp.int32)], axis=1)
        mask = jnp.concatenate([prompt_mask, jnp.zeros((batch, max_new_tokens), bool)], axis=1)

        def step(t, carry):
            ids, mask = carry
            positions = jnp.where(mask, jnp.cumsum(mask, axis=1) - 1, 0)
            logits = model(ids, positions, mask.astype(jnp.int32))
            column = prompt_len + t - 1
            token = jnp.argmax(jax.lax.dynamic_index_in_dim(logits, column, axis=1, keepdims=False), axis=-1)
            ids = jax.lax.dynamic_update_index_in_dim(ids, token.astype(jnp.int32), column + 1, axis=1)
            mask = jax.lax.dynamic_update_index_in_dim(mask, jnp.ones((batch,), bool), column + 1, axis=1)
            return ids, mask

        ids, _ = jax.lax.fori_loop(0, max_new_tokens, step, (ids, mask))
        return ids[:, prompt_len:]

    return decode


def measure(quick: bool, repeats: int) -> dict:
    """Tokens/s of the three decoders on the same model and prompts, their agreement and the two speed-ups."""
    sizes = QUICK if quick else FULL
    threads = match_torch_threads()
    batch, max_new = sizes["batch"], sizes["max_new_tokens"]

    rng = np.random.default_rng(0)
    lengths = rng.integers(sizes["max_prompt"] // 2, sizes["max_prompt"] + 1, size=batch)
    prompts = [rng.integers(1, sizes["vocab"], size=n).tolist() for n in lengths]
    prompt_ids, prompt_mask = pad_prompts(prompts, pad_id=0, multiple=16)

    with tempfile.TemporaryDirectory() as path:
        # the wide initialisation keeps greedy argmaxes away from ties
        hf_model = saved_qwen2(
            path, vocab_size=sizes["vocab"], hidden_size=sizes["hidden"], intermediate_size=2 * sizes["hidden"],
            num_hidden_layers=sizes["layers"], num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3,
            max_position_embeddings=512)
        model = load_pretrained(path)
    graphdef, state = nnx.split(model)
    ids, mask = jnp.asarray(prompt_ids), jnp.asarray(prompt_mask)
    sampler = make_generate_fn(graphdef, SamplingParams(max_new_tokens=max_new, greedy=True))
    recompute = full_recompute_fn(model, max_new)
    key = jax.random.key(0)
    torch_ids, torch_mask = torch.from_numpy(prompt_ids).long(), torch.from_numpy(prompt_mask).long()
    outputs = {}

    def kv_sampler():
        outputs["kv_sampler"] = np.asarray(sampler(state, ids, mask, key).response_ids)

    def full_recompute():
        outputs["recompute"] = np.asarray(recompute(state, ids, mask))

    def hf_generate():
        with torch.no_grad():
            generated = hf_model.generate(
                torch_ids, attention_mask=torch_mask, max_new_tokens=max_new, do_sample=False, pad_token_id=0
            )
        outputs["transformers"] = generated[:, prompt_ids.shape[1] :].numpy()

    timings = time_side_by_side(
        {"kv_sampler": kv_sampler, "recompute": full_recompute, "transformers": hf_generate}, repeats
    )
    tokens = batch * max_new
    methods = {
        name: timing.to_dict() | {
            "tokens_per_s": tokens / timing.median_s,
            "same_tokens_as_kv_sampler": float((outputs[name] == outputs["kv_sampler"]).mean()),
        }
        for name, timing in timings.items()
    }
    speed = {name: method["tokens_per_s"] for name, method in methods.items()}
    return {
        "model": {
            "model_type": "qwen2", "hidden_size": sizes["hidden"], "num_layers": sizes["layers"],
            "vocab_size": sizes["vocab"],
        },
        "prompts": {
            "batch": batch, "min_length": int(lengths.min()), "max_length": int(lengths.max()),
            "padded_to": int(prompt_ids.shape[1]),
        },
        "new_tokens": max_new,
        "torch_threads": threads,
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__},
        "methods": methods,
        "sampler_vs_recompute": speed["kv_sampler"] / speed["recompute"],
        "sampler_vs_transformers": speed["kv_sampler"] / speed["transformers"],
    }


if __name__ == "__main__":
    command("sampler", __doc__, measure)
