"""Device-check stages of the device alone: versions and bf16 matmul throughput, every attention implementation
against ``reference``, and decoding with 8 response-cache blocks against 1.

    python -m bench.device_check.stages versions|attention|decode_blocks --out DIR [--cpu]
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np

from bench.device_check.stage import device_peak_bytes, main, version
from bench.timing import time_side_by_side

LIBRARIES = ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "libtpu", "flax", "optax", "orbax-checkpoint",
             "chex", "numpy", "omegaconf", "tokenizers", "safetensors", "torch", "jppo")


def versions(cpu: bool, out: pathlib.Path) -> dict:
    """The software and devices, and bf16 ``n x n @ n x n`` throughput: ``2 n^3 / t`` over the fastest repeat."""
    n = 256 if cpu else 8192
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    matmul = jax.jit(lambda x, y: x @ y)
    seconds = time_side_by_side({"matmul": lambda: matmul(a, b).block_until_ready()}, 3 if cpu else 20)["matmul"].min_s
    device = jax.devices()[0]
    return {
        "python": platform.python_version(), "executable": sys.executable,
        "versions": {name: version(name) for name in LIBRARIES},
        "backend": jax.default_backend(), "device_kind": device.device_kind, "device_count": jax.device_count(),
        "environment": {name: os.environ.get(name) for name in (
            "XLA_FLAGS", "LIBTPU_INIT_ARGS", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE",
            "CUDA_VISIBLE_DEVICES", "JAX_PLATFORMS")},
        "memory_stats": device.memory_stats(),
        "bf16_matmul": {"n": n, "seconds": seconds, "tflops": 2 * n**3 / seconds / 1e12},
    }


def packed_segments(batch: int, length: int, seed: int = 0) -> np.ndarray:
    """``[B, T]`` segment ids: each row two sequences of random lengths, then padding (a packed micro-batch)."""
    rng = np.random.default_rng(seed)
    segments = np.zeros((batch, length), np.int32)
    for row in range(batch):
        first = int(rng.integers(length // 4, length // 2))
        second = int(rng.integers(length // 4, length - first))
        segments[row, :first], segments[row, first:first + second] = 1, 2
    return segments


def attention(cpu: bool, out: pathlib.Path) -> dict:
    """Forward + backward (``grad`` of ``sum(attention * cotangent)`` in q, k, v) of every implementation of
    ``jppo.models.config.ATTENTION_IMPLEMENTATIONS`` at Qwen2.5-0.5B's heads (14 query, 2 key-value, size 64), bf16
    (float32 on CPU), on packed rows with padding, and the largest error of its output and gradients against
    ``reference``'s, relative to the largest magnitude of ``reference``'s."""
    from jppo.models.attention import AttentionRule  # noqa: PLC0415
    from jppo.models.config import ATTENTION_IMPLEMENTATIONS  # noqa: PLC0415
    from jppo.models.layers import attention as attend  # noqa: PLC0415

    dtype = jnp.float32 if cpu else jnp.bfloat16
    heads, kv_heads, size = (4, 2, 16) if cpu else (14, 2, 64)
    shapes = [(1, 128), (2, 64)] if cpu else [(1, 4096), (2, 1024)]
    results = {}
    for batch, length in shapes:
        keys = jax.random.split(jax.random.key(batch * length), 4)
        q = jax.random.normal(keys[0], (batch, length, heads, size), dtype)
        k = jax.random.normal(keys[1], (batch, length, kv_heads, size), dtype)
        v = jax.random.normal(keys[2], (batch, length, kv_heads, size), dtype)
        cotangent = jax.random.normal(keys[3], q.shape, dtype)
        rule = AttentionRule.packed(jnp.asarray(packed_segments(batch, length)))  # what every implementation takes

        def forward_backward(name):
            def loss(q, k, v):
                o = attend(q, k, v, rule, name)
                return jnp.sum(o.astype(jnp.float32) * cotangent.astype(jnp.float32)), o
            return jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))

        outputs, timings = {}, {}
        for name in ATTENTION_IMPLEMENTATIONS:
            try:
                fn = forward_backward(name)
                grads, o = fn(q, k, v)
                outputs[name] = [np.asarray(x, np.float32) for x in (o, *grads)]
                timings[name] = lambda fn=fn: jax.block_until_ready(fn(q, k, v))
            except Exception as error:  # noqa: BLE001 (cudnn off a GPU, an implementation this device lacks)
                skipped = f"{type(error).__name__}: {error}"[:500]
                results.setdefault(f"B{batch}_T{length}", {})[name] = {"skipped": skipped}
        measured = time_side_by_side(timings, repeats=2 if cpu else 10)
        reference = outputs["reference"]
        for name, timing in measured.items():
            errors = [float(np.max(np.abs(x - r)) / max(float(np.max(np.abs(r))), 1e-30))
                      for x, r in zip(outputs[name], reference)]
            results.setdefault(f"B{batch}_T{length}", {})[name] = {
                **timing.to_dict(), "relative_error": dict(zip(("output", "dq", "dk", "dv"), errors)),
                "vs_reference_time": timing.median_s / measured["reference"].median_s,
            }
    return {"dtype": jnp.dtype(dtype).name, "heads": [heads, kv_heads, size], "implementations":
            list(ATTENTION_IMPLEMENTATIONS), "shapes": results}


def block_knob():
    """How the decode's response-cache block count is chosen: the name of a config field for it (``*block*`` with
    ``response``, ``decode`` or ``cache`` in its name), where the sampler or the model has one (``SamplingParams``
    first), else None (then ``jppo.models.layers.RESPONSE_BLOCKS``,
    read while the decode step is traced, is set for each candidate)."""
    from jppo.models import ModelConfig  # noqa: PLC0415
    from jppo.rollout import SamplingParams  # noqa: PLC0415

    for owner in (SamplingParams, ModelConfig):
        for field in dataclasses.fields(owner):
            words = field.name.split("_")  # attention_block_q is attention's tile, not the cache's block count
            if any(w.startswith("block") for w in words) and {"response", "decode", "cache"} & set(words):
                return owner.__name__, field.name
    return None


def decode_blocks(cpu: bool, out: pathlib.Path) -> dict:
    """Greedy decoding tokens/s of the Qwen2.5-0.5B-shaped random model (bf16) with 8 response-cache blocks and
    with 1 (each a conditional per layer per token: on a GPU every ``lax.cond`` waits for its predicate on the
    host), and whether both chose the same tokens."""
    from flax import nnx  # noqa: PLC0415

    import jppo.models.layers as layers  # noqa: PLC0415
    from bench.accelerator import QWEN2_0_5B, STAND_IN  # noqa: PLC0415
    from jppo.models import CausalLM, ModelConfig, create_model  # noqa: PLC0415
    from jppo.rollout import SamplingParams, make_generate_fn  # noqa: PLC0415

    batch, prompt, new = (2, 8, 64) if cpu else (64, 128, 256)
    knob = block_knob()
    candidates, tokens = {}, {}
    for blocks in (8, 1):
        config = ModelConfig(**(STAND_IN if cpu else QWEN2_0_5B), dtype="bfloat16", param_dtype="bfloat16")
        params = SamplingParams(max_new_tokens=new, greedy=True)
        if knob and knob[0] == "ModelConfig":
            config = dataclasses.replace(config, **{knob[1]: blocks})
        elif knob:
            params = dataclasses.replace(params, **{knob[1]: blocks})
        graphdef, state = nnx.split(create_model(CausalLM, config))
        ids = jnp.asarray(np.random.default_rng(0).integers(1, config.vocab_size, (batch, prompt)), jnp.int32)
        mask = jnp.ones(ids.shape, bool)
        generate = make_generate_fn.__wrapped__(graphdef, params)  # a fresh jit: the cache would hand back the first
        saved, layers.RESPONSE_BLOCKS = layers.RESPONSE_BLOCKS, blocks if knob is None else layers.RESPONSE_BLOCKS
        try:
            first = generate(state, ids, mask, jax.random.key(0))  # traced and compiled with this block count
            tokens[blocks] = np.asarray(first.response_ids)
        finally:
            layers.RESPONSE_BLOCKS = saved
        candidates[f"blocks_{blocks}"] = (
            lambda g=generate, s=state, i=ids, m=mask: jax.block_until_ready(
                g(s, i, m, jax.random.key(0)).response_ids))
    timings = time_side_by_side(candidates, repeats=2 if cpu else 5)
    result = {name: {**t.to_dict(), "tokens_per_s": batch * new / t.median_s} for name, t in timings.items()}
    return {
        "knob": ".".join(knob) if knob else "jppo.models.layers.RESPONSE_BLOCKS (no config key yet)",
        "batch": batch, "prompt": prompt, "new_tokens": new, "candidates": result,
        "blocks_1_over_8_tokens_per_s": result["blocks_1"]["tokens_per_s"] / result["blocks_8"]["tokens_per_s"],
        "same_tokens_fraction": float(np.mean(tokens[8] == tokens[1])),
        "response_blocks_of_8": list(layers.response_blocks(new)), "device_peak_bytes": device_peak_bytes(),
    }


if __name__ == "__main__":
    sys.exit(main({"versions": versions, "attention": attention, "decode_blocks": decode_blocks}))
