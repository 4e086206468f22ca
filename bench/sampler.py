"""Greedy decoding throughput: jppo's KV-cache sampler vs full recomputation vs ``transformers`` ``generate``.

    python -m bench.sampler [--quick]

One tiny random Qwen2-shaped model is built with ``transformers`` (fixed torch seed), saved, and loaded into jppo
with ``jppo.models.load_pretrained``, so all three decode the same weights. The three methods:

- **KV-cache sampler**: ``jppo.rollout.make_generate_fn`` (one prefill, then one token per step from the cache);
- **full recomputation**: one jitted program that, at every step, re-runs the whole forward over a fixed
  ``prompt + max_new_tokens`` buffer (later slots are padding) and takes the argmax: what decoding costs
  without a cache, compiled once;
- **transformers**: ``Qwen2ForCausalLM.generate(do_sample=False)`` on CPU torch, left-padded batch.

Each is warmed up (compilation), then timed over several repeats; the table reports medians. Tokens/s counts
``batch * max_new_tokens`` (no EOS, so every row runs to the end). The script also reports whether the three
produce the same greedy tokens (float32 everywhere; a random model's near-ties may flip an argmax late in a
long greedy run, which is then reported rather than hidden).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from flax import nnx

from jppo.models import CausalLM, load_pretrained
from jppo.rollout import SamplingParams, make_generate_fn, pad_prompts

FULL = dict(batch=8, max_prompt=48, max_new_tokens=64, repeats=5, hidden=128, layers=4, vocab=2048)
QUICK = dict(batch=4, max_prompt=16, max_new_tokens=16, repeats=3, hidden=64, layers=2, vocab=512)


def build_checkpoint(path: str, hidden: int, layers: int, vocab: int) -> transformers.Qwen2ForCausalLM:
    """A random Qwen2 model, saved to ``path``. The wide initialisation keeps greedy argmaxes away from ties."""
    config = transformers.Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        initializer_range=0.3,
    )
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).eval()
    model.save_pretrained(path)
    return model


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


def median_seconds(run: Callable[[], object], repeats: int) -> tuple[float, object]:
    """Median wall time of ``run()`` after one untimed warm-up call; returns it and the last result."""
    result = run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = run()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes and few repeats (a smoke run)")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=torch.get_num_threads(),
        help="torch intra-op threads (default: torch's choice; on a busy machine 1 avoids threads spinning)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.torch_threads)
    sizes = QUICK if args.quick else FULL
    batch, max_new, repeats = sizes["batch"], sizes["max_new_tokens"], sizes["repeats"]

    rng = np.random.default_rng(0)
    lengths = rng.integers(sizes["max_prompt"] // 2, sizes["max_prompt"] + 1, size=batch)
    prompts = [rng.integers(1, sizes["vocab"], size=n).tolist() for n in lengths]
    prompt_ids, prompt_mask = pad_prompts(prompts, pad_id=0, multiple=16)

    with tempfile.TemporaryDirectory() as path:
        hf_model = build_checkpoint(path, sizes["hidden"], sizes["layers"], sizes["vocab"])
        model = load_pretrained(path)
    graphdef, state = nnx.split(model)
    ids, mask = jnp.asarray(prompt_ids), jnp.asarray(prompt_mask)

    sampler = make_generate_fn(graphdef, SamplingParams(max_new_tokens=max_new, greedy=True))
    key = jax.random.key(0)
    kv_time, kv_out = median_seconds(
        lambda: jax.block_until_ready(sampler(state, ids, mask, key).response_ids), repeats
    )
    recompute = full_recompute_fn(model, max_new)
    full_time, full_out = median_seconds(lambda: jax.block_until_ready(recompute(state, ids, mask)), repeats)

    torch_ids, torch_mask = torch.from_numpy(prompt_ids).long(), torch.from_numpy(prompt_mask).long()

    def hf_generate():
        with torch.no_grad():
            return hf_model.generate(
                torch_ids, attention_mask=torch_mask, max_new_tokens=max_new, do_sample=False, pad_token_id=0
            )

    hf_time, hf_out = median_seconds(hf_generate, repeats)
    hf_tokens = hf_out[:, prompt_ids.shape[1] :].numpy()

    kv_tokens = np.asarray(kv_out)
    tokens = batch * max_new
    rows = [
        ("jppo KV-cache sampler", kv_time, kv_tokens),
        ("jppo full recomputation", full_time, np.asarray(full_out)),
        (f"transformers {transformers.__version__} generate (torch {torch.__version__})", hf_time, hf_tokens),
    ]
    print(
        f"\nGreedy decoding, {batch} prompts of {lengths.min()}-{lengths.max()} tokens (padded to "
        f"{prompt_ids.shape[1]}), {max_new} new tokens; Qwen2-shaped: hidden {sizes['hidden']}, "
        f"{sizes['layers']} layers, vocab {sizes['vocab']}; jax on {jax.devices()[0].platform}, "
        f"torch with {torch.get_num_threads()} threads; median of {repeats} after a warm-up.\n"
    )
    print("| method | median s | tokens/s | KV sampler speed-up | same tokens as KV sampler |")
    print("|---|---:|---:|---:|---:|")
    for name, seconds, generated in rows:
        same = (generated == kv_tokens).mean()
        print(f"| {name} | {seconds:.4f} | {tokens / seconds:,.0f} | {seconds / kv_time:.2f}x | {same:.1%} |")


if __name__ == "__main__":
    main()
