"""What the sampler holds per device on an FSDP mesh: XLA's ``memory_analysis()`` of the compiled rollout.

    python -m bench.rollout_memory [--quick] [--before REV] [--devices 8] [--dtype bfloat16]

A random model of Qwen2.5-0.5B's shape (:data:`bench.real_size.QWEN2_5_0_5B`, float32 weights) on a
``fsdp = --devices`` mesh of simulated CPU devices, sampling in ``--dtype``: the sampler's program is lowered on
abstract arrays (``nnx.eval_shape`` and ``ShapeDtypeStruct`` with the parameters' shardings, so nothing is
allocated) and compiled, and its per-device temporaries are read from ``memory_analysis()``. Measured for the code
of git revision ``--before`` (default ``main``, extracted with ``git archive``) and for the working tree, each in
its own process, side by side: before, XLA hoisted every weight's all-gather out of the decoding loop and held the
whole float32 model (and its per-layer slices) per device; after, the sampler's copy is one set of weights in the
sampling dtype (:func:`jppo.models.sharding.decoding_copy`). ``--quick`` uses 2 layers (CI's smoke mode).

Prints, per tree, the temporaries, the parameters' own bytes per device and the full float32 model, and the ratio
``rollout_temp_after_over_before``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
QWEN_LAYERS = 24
SHAPE = dict(prompts=16, prompt_len=128, n=4, new_tokens=256)  # a GSM8K-like rollout batch (2 prompts per device)


def measure(devices: int, dtype: str, layers: int) -> dict:
    """The compiled rollout's memory per device, for the jppo importable in this process."""
    import jax

    jax.config.update("jax_num_cpu_devices", devices)
    import jax.numpy as jnp
    from flax import nnx

    from bench.real_size import QWEN2_5_0_5B
    from jppo.models import CausalLM, ModelConfig, param_shardings
    from jppo.parallel.mesh import batch_spec, make_mesh
    from jppo.rollout import SamplingParams, make_generate_fn

    config = ModelConfig(**(QWEN2_5_0_5B | dict(num_layers=layers)), dtype=dtype, param_dtype="float32")
    mesh = make_mesh(data=1, fsdp=devices)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(0))))
    shardings = param_shardings(state, mesh)
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)
    rows = jax.sharding.NamedSharding(mesh, batch_spec())
    ids = jax.ShapeDtypeStruct((SHAPE["prompts"], SHAPE["prompt_len"]), jnp.int32, sharding=rows)
    mask = jax.ShapeDtypeStruct(ids.shape, jnp.bool_, sharding=rows)
    params = SamplingParams(max_new_tokens=SHAPE["new_tokens"], n=SHAPE["n"])
    with jax.set_mesh(mesh):
        compiled = make_generate_fn(graphdef, params).lower(abstract, ids, mask, jax.random.key(0)).compile()
    stats = compiled.memory_analysis()
    leaves = jax.tree.leaves(state)
    full = sum(int(x.size) * 4 for x in leaves)
    return {"temp_bytes": int(stats.temp_size_in_bytes), "argument_bytes": int(stats.argument_size_in_bytes),
            "full_float32_model_bytes": full, "param_shard_bytes": full // devices, "layers": layers,
            "dtype": dtype, "devices": devices, **SHAPE}


def in_tree(tree: pathlib.Path, args) -> dict:
    """:func:`measure` in a fresh process importing jppo from ``tree`` (this benchmark's own code from here)."""
    env = dict(os.environ, PYTHONPATH=f"{tree}{os.pathsep}{ROOT}")
    code = (f"import json, sys; sys.path[:0] = [{str(tree)!r}, {str(ROOT)!r}]; from bench.rollout_memory import "
            f"measure; print(json.dumps(measure({args.devices}, {args.dtype!r}, {args.layers})))")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tree, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 layers instead of 24")
    parser.add_argument("--before", default="main", help="the git revision measured as 'before'")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16", help="rollout.dtype (the sampler's compute dtype)")
    args = parser.parse_args(argv)
    args.layers = 2 if args.quick else QWEN_LAYERS
    with tempfile.TemporaryDirectory() as scratch:
        archive = subprocess.run(["git", "archive", args.before, "jppo"], cwd=ROOT, check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", scratch], input=archive.stdout, check=True)
        before = in_tree(pathlib.Path(scratch), args)
    after = in_tree(ROOT, args)
    result = {"before": before, "after": after,
              "rollout_temp_after_over_before": after["temp_bytes"] / before["temp_bytes"]}
    gb = 1e9
    print(f"rollout of Qwen2.5-0.5B's shape ({args.layers} layers), fsdp={args.devices}, rollout.dtype={args.dtype}: "
          f"{SHAPE['prompts']} prompts x {SHAPE['prompt_len']} tokens, n={SHAPE['n']}, {SHAPE['new_tokens']} new "
          f"tokens; per device")
    for name, m in (("before (" + args.before + ")", before), ("after (working tree)", after)):
        print(f"  {name:<22} temporaries {m['temp_bytes'] / gb:6.3f} GB   param shards {m['param_shard_bytes'] / gb:6.3f}"
              f" GB   full float32 model {m['full_float32_model_bytes'] / gb:6.3f} GB")
    print(f"  rollout_temp_after_over_before = {result['rollout_temp_after_over_before']:.3f}")
    return result


if __name__ == "__main__":
    main()
