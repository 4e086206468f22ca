"""Attention implementations side by side (``model.attention``): the forward and backward pass of a small model's
summed token log-probs on packed rows with padding, under the reference and the XLA-lowered fused implementation, float32, in
interleaved rounds. On CPU the faster one is ``auto``'s fallback (jppo.models.layers.AUTO_FALLBACK).

    python -m bench.attention [--quick]
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


def packed_batch(batch: int, length: int, vocab: int, seed: int = 0):
    """Ids, positions, segment ids: each row two sequences of random lengths, then padding."""
    rng = np.random.default_rng(seed)
    segments = np.zeros((batch, length), np.int32)
    positions = np.zeros((batch, length), np.int32)
    for row in range(batch):
        first, second = rng.integers(length // 4, length // 2, 2)
        segments[row, :first], segments[row, first:first + second] = 1, 2
        positions[row, :first], positions[row, first:first + second] = np.arange(first), np.arange(second)
    ids = np.where(segments > 0, rng.integers(0, vocab, (batch, length)), 0).astype(np.int32)
    return ids, positions, segments


def candidate(config: ModelConfig, implementation: str, batch):
    """A callable running one jitted forward+backward pass with ``attention=implementation``."""
    model = create_model(CausalLM, dataclasses.replace(config, attention=implementation), seed=0)
    graphdef, state = nnx.split(model)
    ids, positions, segments = batch

    @jax.jit
    def grad(state):
        def loss(state):
            log_probs, _ = token_log_probs(nnx.merge(graphdef, state), ids, positions, segments, ids)
            return jnp.sum(log_probs * (segments > 0))
        return jax.grad(loss)(state)

    return lambda: jax.block_until_ready(grad(state))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes (smoke mode; numbers mean nothing)")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    batch, length, width = (2, 32, 64) if args.quick else (8, 256, 256)
    config = ModelConfig(vocab_size=512, hidden_size=width, intermediate_size=4 * width, num_layers=2, num_heads=4,
                         model_type="qwen2", max_position_embeddings=length)
    data = packed_batch(batch, length, config.vocab_size)
    timings = time_side_by_side({name: candidate(config, name, data) for name in ("reference", "xla")},
                                repeats=2 if args.quick else args.repeats)
    result = {
        "backend": jax.default_backend(), "shape": dict(batch=batch, length=length, hidden=width, heads=4, layers=2),
        "timings": {name: timing.to_dict() for name, timing in timings.items()},
        "xla_over_reference": timings["xla"].median_s / timings["reference"].median_s,
    }
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
