"""Long rows: one update step of a small model (2 layers d256, 4 heads) on one packed row of T tokens, with
``model.attention: reference`` (dense ``[T, T]`` scores) and ``blockwise`` (linear memory), side by side: XLA's
temporary bytes of the compiled step (``memory_analysis()``, exact and noise-free) and its time in interleaved
rounds, for T in 1k, 2k, 4k, 8k.

    python -m bench.long_context [--quick] [--repeats N] [--lengths 1024,2048]

The step is ``params - lr * grad`` of the summed token log-probs of a row holding three sequences (a quarter, a
half and the rest but 64 tokens of padding), float32. Headlines: ``attention_memory_ratio_8k`` (blockwise /
reference temporaries at 8k; target <= 0.125) and ``attention_time_ratio_4k`` (blockwise / reference median
seconds at 4k; target <= 1.2 on a CPU). Memory is measured at every length; time only up to 4k in full mode
(the reference's step at 8k takes seconds per round on a CPU, and its time is not a headline).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench.timing import time_side_by_side
from jppo.models import CausalLM, ModelConfig, create_model, token_log_probs

LENGTHS = (1024, 2048, 4096, 8192)
QUICK_LENGTHS = (256,)  # one length: CI's smoke run only checks the keys
TIMED_UP_TO = 4096
IMPLEMENTATIONS = ("reference", "blockwise")
MIB = 2**20


def packed_row(length: int, vocab: int, seed: int = 0):
    """Ids, positions and segment ids ``[1, length]``: sequences of a quarter, a half and the rest of the row but
    64 tokens, then padding (segment 0)."""
    bounds = [0, length // 4, length // 4 + length // 2, length - min(64, length // 8), length]
    segments, positions = np.zeros((1, length), np.int32), np.zeros((1, length), np.int32)
    for segment, (start, end) in enumerate(zip(bounds[:3], bounds[1:4]), start=1):
        segments[0, start:end], positions[0, start:end] = segment, np.arange(end - start)
    ids = np.where(segments > 0, np.random.default_rng(seed).integers(0, vocab, (1, length)), 0).astype(np.int32)
    return ids, positions, segments


def model_config(width: int = 256, length: int = 8192) -> ModelConfig:
    return ModelConfig(vocab_size=512, hidden_size=width, intermediate_size=4 * width, num_layers=2, num_heads=4,
                       model_type="qwen2", max_position_embeddings=length)


def update_step(config: ModelConfig, implementation: str, row):
    """The compiled step for ``attention=implementation`` and its arguments (the model's state and the row).

    The row is an argument, as in training: closed over as a constant, XLA folds the segments into the block
    skipping's conditions and unrolls the loops into ``[blocks, blocks, ...]`` temporaries no run would have."""
    model = create_model(CausalLM, dataclasses.replace(config, attention=implementation), seed=0)
    graphdef, state = nnx.split(model)
    ids, positions, segments = (jnp.asarray(x) for x in row)

    def step(state, ids, positions, segments):
        def loss(state):
            targets = jnp.roll(ids, -1, axis=1)
            log_probs, _ = token_log_probs(nnx.merge(graphdef, state), ids, positions, segments, targets)
            return -jnp.sum(jnp.where(segments > 0, log_probs, 0.0))
        grads = jax.grad(loss)(state)
        return jax.tree.map(lambda p, g: p - 1e-3 * g, state, grads)

    args = (state, ids, positions, segments)
    return jax.jit(step).lower(*args).compile(), args


def measure(quick: bool, repeats: int, lengths: tuple[int, ...] | None = None) -> dict:
    lengths = lengths or (QUICK_LENGTHS if quick else LENGTHS)
    config = model_config(64 if quick else 256, max(lengths))
    rows = {}
    for length in lengths:
        row = packed_row(length, config.vocab_size)
        compiled = {name: update_step(config, name, row) for name in IMPLEMENTATIONS}
        result = {name: {"xla_temp_bytes": int(step.memory_analysis().temp_size_in_bytes)}
                  for name, (step, _) in compiled.items()}
        if quick or length <= TIMED_UP_TO:
            timings = time_side_by_side(
                {name: (lambda step=step, args=args: jax.block_until_ready(step(*args)))
                 for name, (step, args) in compiled.items()}, repeats=repeats)
            for name, timing in timings.items():
                result[name].update(timing.to_dict())
        reference, blockwise = result["reference"], result["blockwise"]
        result["memory_ratio"] = blockwise["xla_temp_bytes"] / reference["xla_temp_bytes"]
        if "median_s" in reference:
            result["time_ratio"] = blockwise["median_s"] / reference["median_s"]
        rows[str(length)] = result
        print(f"T={length}: " + ", ".join(
            f"{name} {result[name]['xla_temp_bytes'] / MIB:.1f} MiB"
            + (f" {1e3 * result[name]['median_s']:.0f} ms" if "median_s" in result[name] else "")
            for name in IMPLEMENTATIONS), flush=True)
    last, timed = str(lengths[-1]), [length for length in map(str, lengths) if "time_ratio" in rows[length]]
    return {
        "backend": jax.default_backend(),
        "model": dict(layers=config.num_layers, hidden=config.hidden_size, heads=config.num_heads),
        "blocks": dict(block_q=config.attention_block_q, block_kv=config.attention_block_kv),
        "lengths": rows,
        "attention_memory_ratio_8k": rows.get("8192", rows[last])["memory_ratio"],
        "attention_time_ratio_4k": rows.get("4096", rows[timed[-1]])["time_ratio"] if timed else None,
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes (smoke mode; numbers mean nothing)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--lengths", type=lambda text: tuple(int(x) for x in text.split(",")), default=None)
    args = parser.parse_args(argv)
    result = measure(args.quick, 2 if args.quick else args.repeats, args.lengths)
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
