"""Sampling throughput at a GSM8K-like shape: jppo's KV-cache sampler vs ``transformers`` ``generate`` (KV cache).

    python -m bench.rollout_shapes [--quick] [--repeats N]

One random Qwen2 model (4 layers d256, intermediate 1024, 4 heads, vocabulary 1024) is built by ``transformers``
(fixed torch seed), saved, and loaded into jppo with ``jppo.models.load_pretrained``, so both decode the same
weights. 8 prompts of 64 random tokens, ``n = 8`` samples each (64 rows), 128 new tokens, sampling at temperature 1
with no top-k / top-p filter on both sides. EOS is suppressed: jppo's :class:`~jppo.rollout.SamplingParams` gets
no ``eos_token_ids`` and ``generate`` gets ``eos_token_id=None``, so every row runs to 128 tokens and both do the
same number of decode steps (the lengths are checked). jppo is called through its public API only
(``jppo.rollout.make_generate_fn``); ``generate`` runs with ``use_cache=True`` and ``num_return_sequences=8``
(the prompt is prefilled once per sample there, once per prompt in jppo).

The two are timed side by side (:func:`bench.timing.time_side_by_side`: a warm-up call, then interleaved rounds),
torch with as many threads as XLA's CPU pool. Tokens/s counts ``rows * new tokens``. The ratio is jppo tokens/s
over transformers tokens/s (> 1: jppo faster).
"""

from __future__ import annotations

import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from flax import nnx

from bench.environment import match_torch_threads
from bench.report import command
from bench.timing import time_side_by_side
from jppo.models import load_pretrained
from jppo.rollout import SamplingParams, make_generate_fn

GSM8K_SHAPE = dict(prompts=8, n=8, prompt_length=64, new_tokens=128, hidden=256, intermediate=1024, layers=4,
                   heads=4, vocab=1024)
QUICK = dict(prompts=2, n=2, prompt_length=8, new_tokens=8, hidden=32, intermediate=64, layers=2, heads=4, vocab=64)


def saved_qwen2(path: str, **config) -> transformers.Qwen2ForCausalLM:
    """A random ``Qwen2ForCausalLM`` of ``config`` (``transformers.Qwen2Config``'s names; torch seed 0, untied head),
    saved to ``path`` for jppo's ``load_pretrained``, so both sides decode the same weights. No EOS id: nothing
    ends a row early on either side."""
    config = transformers.Qwen2Config(tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=0,
                                      **config)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    return model


def measure(quick: bool, repeats: int) -> dict:
    """Tokens/s of jppo's sampler and of ``generate`` on the same model, prompts and lengths, and their ratio."""
    size = QUICK if quick else GSM8K_SHAPE
    threads = match_torch_threads()
    prompts, n, new = size["prompts"], size["n"], size["new_tokens"]
    rng = np.random.default_rng(0)
    prompt_ids = rng.integers(1, size["vocab"], size=(prompts, size["prompt_length"])).astype(np.int32)
    prompt_mask = np.ones_like(prompt_ids, dtype=bool)
    with tempfile.TemporaryDirectory() as path:
        hf_model = saved_qwen2(
            path, vocab_size=size["vocab"], hidden_size=size["hidden"], intermediate_size=size["intermediate"],
            num_hidden_layers=size["layers"], num_attention_heads=size["heads"], num_key_value_heads=size["heads"],
            max_position_embeddings=max(512, size["prompt_length"] + size["new_tokens"]))
        model = load_pretrained(path)
    graphdef, state = nnx.split(model)
    sampler = make_generate_fn(graphdef, SamplingParams(max_new_tokens=new, temperature=1.0, n=n))
    ids, mask = jnp.asarray(prompt_ids), jnp.asarray(prompt_mask)
    torch_ids = torch.from_numpy(prompt_ids).long()
    lengths: dict[str, np.ndarray] = {}
    calls = {"jppo": 0}

    def jppo_sample():
        calls["jppo"] += 1
        out = sampler(state, ids, mask, jax.random.key(calls["jppo"]))
        lengths["jppo"] = np.asarray(out.response_mask).sum(axis=1)

    def hf_generate():
        with torch.no_grad():
            out = hf_model.generate(
                torch_ids, attention_mask=torch.ones_like(torch_ids), max_new_tokens=new, do_sample=True,
                temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=n, eos_token_id=None, pad_token_id=0,
                use_cache=True,
            )
        lengths["transformers"] = np.full(out.shape[0], out.shape[1] - prompt_ids.shape[1])

    timings = time_side_by_side({"jppo": jppo_sample, "transformers": hf_generate}, repeats)
    rows = prompts * n
    for name, got in lengths.items():
        if got.shape != (rows,) or not (got == new).all():
            raise RuntimeError(f"{name} gave response lengths {sorted(set(got.tolist()))}, not {new} for all {rows}")
    methods = {
        name: timing.to_dict() | {"tokens_per_s": rows * new / timing.median_s} for name, timing in timings.items()
    }
    return {
        "model": {"model_type": "qwen2", **{key: size[key] for key in ("hidden", "intermediate", "layers", "heads",
                                                                     "vocab")}},
        "prompts": prompts, "n": n, "rows": rows, "prompt_length": size["prompt_length"], "new_tokens": new,
        "eos": "suppressed: every row runs to new_tokens",
        "sampling": "temperature 1, no top-k / top-p",
        "torch_threads": threads,
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__},
        "methods": methods,
        "rollout_vs_transformers": methods["jppo"]["tokens_per_s"] / methods["transformers"]["tokens_per_s"],
    }


if __name__ == "__main__":
    command("rollout_shapes", __doc__, measure)
