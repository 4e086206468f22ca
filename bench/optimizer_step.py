"""What gradient accumulation costs the optimizer: optax's stock ``MultiSteps`` against jppo's accumulation, per
mini-batch of K micro-steps, on the parameter shapes of Qwen2.5-0.5B.

    python -m bench.optimizer_step [--layers N] [--ks 1,4,16] [--repeats R] [--bf16]

optax 0.2.8's ``MultiSteps.update`` runs the whole inner chain (gradient-norm record, non-finite guard, clipping,
AdamW) on every micro-step and keeps its result only on the K-th (a ``where``), and hands the inner chain the
accumulator cast to the gradient's dtype. jppo's update step (:mod:`jppo.engine.update`) only adds micro-steps
1..K-1 into the same ``MultiStepsState`` and runs the inner chain once, on the float32 sum
(:func:`jppo.engine.optim.apply_accumulated`). Both are timed here side by side in one process, on the same
parameter tree, without the model: each micro-step's "gradient" is a cheap elementwise function of the parameters,
so what differs is exactly the optimizer's work. Memory is XLA's ``memory_analysis()`` of each compiled mini-batch
(temporaries beyond the donated state).

The parameter tree is Qwen2.5-0.5B's (vocabulary 151936, hidden 896, MLP 4864; tied embeddings) with ``--layers``
of its 24 layers (default 4, so the float32 state fits beside other work on a small machine); the optimizer's cost
is linear in the parameter count, and the printout scales it to the whole 494M-parameter model.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from bench.real_size import QWEN2_5_0_5B
from bench.timing import time_side_by_side
from jppo.core.settings import OptimConfig
from jppo.engine.optim import accumulating_optimizer, apply_accumulated, inner_optimizer
from jppo.models import CausalLM, ModelConfig


def parameter_shapes(layers: int, dtype) -> tuple[dict, int, int]:
    """Abstract parameters of the model with ``layers`` layers, and the element counts of it and of the 24-layer
    model."""

    def count(num_layers: int) -> tuple[object, int]:
        cfg = ModelConfig(**(QWEN2_5_0_5B | dict(num_layers=num_layers)), param_dtype=jnp.dtype(dtype).name)
        abstract = nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)))
        state = nnx.state(abstract, nnx.Param)
        return state, sum(x.size for x in jax.tree.leaves(state))

    state, elements = count(layers)
    _, full = count(QWEN2_5_0_5B["num_layers"])
    return state, elements, full


def fake_gradient(params, k):
    """A micro-step's stand-in gradient: cheap, parameter-shaped, different per micro-step, finite."""
    scale = 1e-3 * (k + 1).astype(jnp.float32)
    return jax.tree.map(lambda p: (p * scale).astype(p.dtype), params)


def stock_mini_batch(tx: optax.MultiSteps, k: int):
    """K micro-steps through ``MultiSteps.update`` (the inner chain computed on each)."""

    def run(params, opt_state):
        def micro(carry, index):
            params, opt_state = carry
            updates, opt_state = tx.update(
                fake_gradient(params, index), opt_state, params, optimizer_step=opt_state.gradient_step
            )
            return (optax.apply_updates(params, updates), opt_state), None

        return jax.lax.scan(micro, (params, opt_state), jnp.arange(k))[0]

    return run


def jppo_mini_batch(inner: optax.GradientTransformation, k: int):
    """K micro-steps as jppo's update step runs them: add 1..K-1, apply the inner chain on the K-th."""

    def run(params, opt_state):
        def micro(carry, index):
            params, opt_state = carry
            grads = jax.tree.map(lambda g, acc: g.astype(acc.dtype), fake_gradient(params, index), opt_state.acc_grads)

            def accumulate(params, opt_state, grads):
                acc = jax.tree.map(jnp.add, opt_state.acc_grads, grads)
                return params, opt_state._replace(acc_grads=acc, mini_step=opt_state.mini_step + 1)

            def last(params, opt_state, grads):
                return apply_accumulated(inner, grads, opt_state, params)

            return jax.lax.cond(opt_state.mini_step == k - 1, last, accumulate, params, opt_state, grads), None

        return jax.lax.scan(micro, (params, opt_state), jnp.arange(k))[0]

    return run


@dataclasses.dataclass
class Candidate:
    """One compiled mini-batch and its state, callable as the side-by-side timer expects."""

    run: object
    params: object
    opt_state: object

    def __call__(self):
        self.params, self.opt_state = self.run(self.params, self.opt_state)
        jax.block_until_ready(self.params)


def build(kind: str, k: int, abstract, dtype) -> tuple[Candidate, int]:
    optim = OptimConfig(lr=1e-6, grad_clip=1.0)
    params = jax.tree.map(lambda a: jnp.full(a.shape, 0.01, dtype), abstract)
    if kind == "stock":
        tx = optax.MultiSteps(inner_optimizer(optim), every_k_schedule=k, use_grad_mean=False)
        fn = stock_mini_batch(tx, k)
    else:
        tx = accumulating_optimizer(optim, k, jnp.float32)
        fn = jppo_mini_batch(inner_optimizer(optim), k)
    # fresh buffers for every leaf: init may hand the same zero array to several leaves, which cannot be donated twice
    opt_state = jax.tree.map(jnp.copy, tx.init(params))
    compiled = jax.jit(fn, donate_argnums=(0, 1)).lower(params, opt_state).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    return Candidate(compiled, params, opt_state), temp


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--ks", default="1,4,16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bf16", action="store_true", help="bfloat16 parameters (float32 accumulator and moments)")
    args = parser.parse_args(argv)
    dtype = jnp.bfloat16 if args.bf16 else jnp.float32
    abstract, elements, full = parameter_shapes(args.layers, dtype)
    scale = full / elements
    result = {"parameters": elements, "parameters_0_5b": full, "dtype": jnp.dtype(dtype).name, "by_k": {}}
    for k in (int(x) for x in args.ks.split(",")):
        candidates, temps = {}, {}
        for kind in ("stock", "jppo"):
            candidates[kind], temps[kind] = build(kind, k, abstract, dtype)
        timings = time_side_by_side(candidates, args.repeats)
        row = {
            kind: {
                "seconds_per_mini_batch": timings[kind].median_s,
                "seconds_per_mini_batch_0_5b": timings[kind].median_s * scale,
                "xla_temp_bytes": temps[kind], "xla_temp_bytes_0_5b": int(temps[kind] * scale),
            }
            for kind in candidates
        }
        row["stock_over_jppo_time"] = timings["stock"].median_s / timings["jppo"].median_s
        row["stock_over_jppo_temp"] = temps["stock"] / max(temps["jppo"], 1)
        result["by_k"][k] = row
        print(
            f"K={k:>2}: stock {timings['stock'].median_s:.3f} s, jppo {timings['jppo'].median_s:.3f} s per mini-batch "
            f"({row['stock_over_jppo_time']:.2f}x); at 0.5B: {row['stock']['seconds_per_mini_batch_0_5b']:.2f} vs "
            f"{row['jppo']['seconds_per_mini_batch_0_5b']:.2f} s; XLA temporaries at 0.5B "
            f"{row['stock']['xla_temp_bytes_0_5b'] / 2**30:.2f} vs {row['jppo']['xla_temp_bytes_0_5b'] / 2**30:.2f} GiB",
            flush=True,
        )
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
