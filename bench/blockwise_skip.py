"""Blockwise attention with and without its conditionals (``blockwise_attention(skip=...)``): the forward and
backward pass of one attention call on packed causal rows, skipping the block pairs nothing sees by one
``lax.cond`` each (``skip``, what the CPU and TPU run) against computing every pair, the invisible ones adding
zeros (``mask``, what a GPU runs: XLA:GPU waits on the host for every conditional), float32, interleaved rounds.

    python -m bench.blockwise_skip [--quick]
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from bench.timing import time_side_by_side
from jppo.models.attention import AttentionRule, blockwise_attention


def candidate(skip: bool, length: int, block: int, heads: int = 4, kv_heads: int = 2, head_dim: int = 64):
    """A callable running one jitted forward+backward pass of blockwise attention over two rows of ``length``
    tokens (two sequences each, then 64 tokens of padding) in ``block x block`` blocks."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, length, heads, head_dim)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, length, kv_heads, head_dim)), jnp.float32) for _ in range(2))
    cut, end = length // 3, length - 64
    segments = np.zeros((2, length), np.int32)
    segments[:, :cut], segments[:, cut:end] = 1, 2
    rule = AttentionRule.packed(jnp.asarray(segments))

    @jax.jit
    def grads(q, k, v):
        def loss(q, k, v):
            return jnp.sum(blockwise_attention(q, k, v, *rule, block_q=block, block_kv=block, skip=skip) ** 2)
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    return lambda: jax.block_until_ready(grads(q, k, v))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes (smoke mode; numbers mean nothing)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    shapes = [(256, 64)] if args.quick else [(1024, 256), (2048, 512), (4096, 512), (4096, 256)]
    results = {}
    for length, block in shapes:
        timings = time_side_by_side({"skip": candidate(True, length, block), "mask": candidate(False, length, block)},
                                    args.repeats)
        key = f"T{length}_block{block}"
        results[key] = {name: t.median_s for name, t in timings.items()}
        results[key]["mask_vs_skip"] = timings["mask"].median_s / timings["skip"].median_s
        print(key, json.dumps(results[key]), flush=True)
    return results


if __name__ == "__main__":
    main()
