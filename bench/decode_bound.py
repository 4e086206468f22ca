"""What one decoded token reads per device, beside its lower bound, for the shipped configs' rollouts.

    python -m bench.decode_bound [--target cpu|v5p:2x2x2|h100x8|...] [--quick] [--json]

For each ``configs/*.yaml``, its mesh on 8 devices (the simulated CPU devices, or the compile-only devices of a TPU
slice or a GPU node with ``--target``), its rollout's shape (``data.train_batch_size`` prompts filled up to the
sampler's shards, ``rollout.n``, the bucketed prompt width, ``rollout.max_response_length``) and its policy's shape
(the GSM8K configs: Qwen2.5-0.5B's, :data:`bench.real_size.QWEN2_5_0_5B`; ``--quick``: 2 of its layers), sampling in
``rollout.dtype``. Everything is abstract (no weights, no data): the sampler's preparation (its copy of the weights,
the prefill, the empty response cache, in the target's cache blocks) is compiled, then ONE decoding step as the
rollout's loop runs it (on each device's own rows), at a slot fixed at trace time: the last one (every slot
visible) and the last of the first quarter of the response (``at 1/4``). The blocks no row sees at that slot are
left out of the program (a run skips them by a conditional, whose branches the cost model would count alike).

Per device: ``read`` = the decoding step's ``bytes accessed`` by XLA's cost analysis (:func:`bytes_accessed`; a
single step: no loop whose body the cost model would count once), compiled for a TPU without its memory-space
prefetches (:data:`MSA_OFF`: the cost model counts a prefetched buffer again at each of its copy's ends;
``prefetched/bound`` is the same step compiled as a run compiles it); on a TPU the decoding kernel's bytes are
those it declares (:mod:`jppo.models.decode_kernel`: the tiles it fetches at that slot), which the cost model cannot
see into; ``bound`` = the bytes a step cannot avoid reading, the device's shards of the sampler's weights and of the
live caches (the prompt cache and the response cache up to the current slot); ``ratio = read / bound`` at the last
slot (the aim: <= 1.5; ``at 1/4`` the same a quarter of the way); ``excess / logits``, what the step reads beyond
the bound in units of the device's float32 logits (the sampling's passes over the vocabulary); ``collectives``;
``prefill / model``: the prompt pass's matrix-product flops (:func:`jppo.preflight.hlo.flops`, its cache and first
logits compiled alone) over the model's on the device's distinct prompt tokens, each prompt once with causal
attention and the head on its last token (the aim: <= 1.2; a prompt computed for each of its ``rollout.n`` rows
would give about ``n``; the rest is mostly attention's masked half, which the pass computes too).
On XLA:CPU a bfloat16 matmul is computed in float32, so its operands are converted and read twice: the CPU ratio
over-states a TPU's or GPU's. On a GPU the cost analysis counts a gather's whole table (the embedding lookup:
the table's bytes again per step), which a run does not read. What a whole compiled rollout communicates per
decoded token is :func:`jppo.preflight.hlo.decode_step_collectives` (``python -m jppo.plan --compile-for``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
# XLA:TPU's memory-space assignment prefetches weights and caches from HBM into on-chip memory ahead of their use;
# the cost model then counts such a buffer several times (the copy's read and write, its completion, the
# consumer's read: 6 matmuls of 49.9 MiB of weights count 250 MiB with it, 50.7 without). The step is measured
# compiled without it, so that each operation's reads count once, as HBM serves them.
MSA_OFF = {"xla_msa_enable": False}


def bytes_accessed(compiled) -> float:
    """The compiled program's ``bytes accessed`` by XLA's cost analysis. A GPU program compiled with compile-only
    devices has none (``cost_analysis()`` is None): then XLA's analysis of its optimized HLO (fusions, library
    calls and all), run by this host's CPU client."""
    import jax
    import jaxlib._hlo as hlo_module
    from jax._src.lib import xla_client

    cost = compiled.cost_analysis()
    if cost is None:
        module = hlo_module.hlo_module_from_text(compiled.as_text())
        cost = xla_client._xla.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module)
    return float(cost["bytes accessed"])


def device_bytes(tree) -> int:
    """Bytes of one device's shards of every array of ``tree`` (``ShapeDtypeStruct`` with shardings)."""
    import jax

    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def load(path: pathlib.Path, tmp: pathlib.Path, quick: bool, overrides: tuple[str, ...] = ()):
    """The config at ``path`` (with ``overrides``); the GSM8K configs with Qwen2.5-0.5B's ``config.json`` and a
    stand-in data file."""
    from bench.real_size import QWEN2_5_0_5B
    from jppo.config import load_config
    from jppo.models import ModelConfig

    text = path.read_text()
    if "/path/to/" not in text:
        return load_config(path, (["model.num_layers=2"] if quick and "num_layers" not in text else []) + [*overrides])
    model, data = tmp / "model", tmp / "rows.jsonl"
    model.mkdir(exist_ok=True)
    shape = QWEN2_5_0_5B | (dict(num_layers=2) if quick else {})
    (model / "config.json").write_text(json.dumps(ModelConfig(**shape).to_hf()))
    data.write_text('{"prompt": "1+1?", "answer": "#### 2"}\n' * 2)
    return load_config(path, [f"model.path={model}", "model.tokenizer=builtin:reverse_digits",
                              f"data.train_files={data}", f"data.val_files={data}", "data.apply_chat_template=false",
                              *overrides])


def is_sft(path: pathlib.Path) -> bool:
    """Whether the config at ``path`` is an SFT run's (``python -m jppo.sft``): it samples nothing to measure."""
    import yaml

    return "sft" in (yaml.safe_load(path.read_text()) or {})


def measure(path: pathlib.Path, target: str, quick: bool, tmp: pathlib.Path, overrides: tuple[str, ...] = (),
            vocab_size: int | None = None, extras: bool = True) -> dict:
    """The decoding step's bytes per device against its bound, for the config at ``path`` (with ``overrides``, and
    the policy's vocabulary ``vocab_size`` where given) on ``target``; ``extras``: also the prefill's flops and the
    step as a run compiles it (with a TPU's prefetches)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from jppo.config import check_mesh
    from jppo.config.views import adapted_model_config, sampling_config
    from jppo.models import CausalLM, param_shardings
    from jppo.parallel.mesh import batch_spec, decoding_layout, decoding_shards, make_mesh, on_each_device
    from jppo.preflight import hlo
    from jppo.preflight.sampler_memory import sampler_prompt_width
    from jppo.preflight.targets import target as compile_target
    from jppo.rollout.decode import draw, loop_axes, prefill, response_cache
    from jppo.rollout.params import SamplingParams

    cfg = load(path, tmp, quick, overrides)
    shape = check_mesh(cfg, 8)
    devices = jax.devices() if target == "cpu" else compile_target(target).devices
    tpu = ":" in target  # a TPU slice (else a GPU node, h100x8, or the simulated CPU devices)
    mesh = make_mesh(*shape, devices=devices)
    policy = dataclasses.replace(adapted_model_config(cfg, "actor"), param_dtype=cfg.model.param_dtype,
                                 dtype=cfg.model.dtype, attention=cfg.model.attention)
    if vocab_size:
        policy = dataclasses.replace(policy, vocab_size=vocab_size)
    config = sampling_config(cfg, policy)
    if target != "cpu" and config.attention in ("auto", "pallas"):
        config = dataclasses.replace(config, attention="blockwise")  # the prefill's Pallas kernel is partitioned apart
    shards = decoding_shards(mesh.shape)
    prompts = -(-cfg.data.train_batch_size // shards) * shards
    rows, width, slots = prompts * cfg.rollout.n, sampler_prompt_width(cfg), cfg.rollout.max_response_length
    graphdef, state = nnx.split(nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(0))))
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state,
                            param_shardings(state, mesh))
    by_row = NamedSharding(mesh, batch_spec())
    ids = jax.ShapeDtypeStruct((prompts, width), jnp.int32, sharding=by_row)
    mask = jax.ShapeDtypeStruct((prompts, width), jnp.bool_, sharding=by_row)
    params = SamplingParams(max_new_tokens=slots, n=cfg.rollout.n, temperature=cfg.rollout.temperature)

    def prepare(state, ids, mask):
        with decoding_layout():
            model = nnx.merge(graphdef, state).for_decoding()
            layers = model.decoding_layers()
            prompt, counts, _ = prefill(model, ids, mask, layers)
            return nnx.state(model), layers, prompt, jnp.repeat(counts, params.n), response_cache(model, rows, params)

    def step(state, layers, prompt, counts, cache, tokens, keys, slot: int):
        # the slot fixed at trace time: the program reads what a step at that slot reads, and with a conditional per
        # cache block (on a CPU) the blocks no row sees yet are out of the program, not a branch the cost model counts
        with decoding_layout():
            model = nnx.merge(graphdef, state)

            def one(tokens, counts, prompt, cache, keys, layers):  # on each device's own rows, as the rollout runs
                hidden, cache = model.decode(tokens, counts + slot, prompt, cache, slot, layers)
                return draw(keys, jnp.broadcast_to(slot, tokens.shape), model.logits(hidden), params), cache

            return on_each_device(one, loop_axes(model, rows, params), (tokens, counts, prompt, cache, keys),
                                  (layers,))

    def prefill_pass(state, ids, mask):  # the prompt pass as the rollout runs it: its cache and first logits
        with decoding_layout():
            model = nnx.merge(graphdef, state).for_decoding()
            return prefill(model, ids, mask, model.decoding_layers())

    with jax.set_mesh(mesh):
        prefill_flops = hlo.flops(hlo.parse(jax.jit(prefill_pass).lower(abstract, ids, mask).compile().as_text())) \
            if extras else None
        prepared = jax.jit(prepare).lower(abstract, ids, mask).compile()
        outputs = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                               jax.eval_shape(prepare, abstract, ids, mask), prepared.output_shardings)
        spec = NamedSharding(mesh, PartitionSpec(("data", "fsdp", "sequence")))
        tokens = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=spec)
        keys = jax.ShapeDtypeStruct((rows,), jax.eval_shape(lambda: jax.random.key(0)).dtype, sharding=spec)
        at = {}  # the step's bytes at the last slot and a quarter of the way (visible slots: read_bytes)
        for name, visible in (("last", slots), ("quarter", max(1, slots // 4))):
            lowered = jax.jit(step, donate_argnums=(4,), static_argnums=(7,)).lower(*outputs, tokens, keys,
                                                                                   visible - 1)
            compiled = lowered.compile(compiler_options=MSA_OFF if tpu else None)
            at[name] = (visible, bytes_accessed(compiled), compiled)
            if name == "last":
                prefetching = lowered.compile() if tpu and extras else compiled
    copies, layers, prompt, _, cache = outputs
    # what a step reads of the model's own state: the embedding and LM head copies and the final norm (the stacked
    # layers in it are unused: a step reads each layer's copy in ``layers``)
    read_whole = [leaf for where, leaf in jax.tree_util.tree_flatten_with_path(copies)[0]
                  if "layers" not in jax.tree_util.keystr(where)]
    weights = device_bytes(layers) + device_bytes(read_whole)
    caches = device_bytes(prompt) + device_bytes(cache)
    (_, read, compiled), (quarter_slots, quarter_read, _) = at["last"], at["quarter"]
    quarter_bound = weights + device_bytes(prompt) + device_bytes(cache) * quarter_slots / slots
    # the prefill against the model's flops on the device's distinct prompt tokens: each prompt once (its rollout.n
    # rows share its cache), every layer's products, causal attention (its scores and their product with values)
    # and the LM head on each prompt's last token
    d, f, q, kv = config.hidden_size, config.intermediate_size, config.num_heads * config.head_dim, \
        config.num_kv_heads * config.head_dim
    local_prompts = prompts // shards
    model_flops = local_prompts * (config.num_layers * (
        2 * width * (d * (q + 2 * kv) + q * d + 3 * d * f) + 2 * q * width * width) + 2 * d * config.vocab_size)
    counted = bytes_accessed(prefetching)
    return {"config": path.name, "target": target, "mesh": dict(zip(("data", "fsdp", "tensor", "sequence"), shape)),
            "layers": config.num_layers, "rows_per_device": rows // shards, "prompt_width": width, "slots": slots,
            "weights_bytes": weights, "cache_bytes": caches, "bound_bytes": weights + caches, "read_bytes": read,
            "ratio": read / (weights + caches), "prefetch_counted_bytes": counted,
            "quarter_slots": quarter_slots, "quarter_bound_bytes": quarter_bound, "quarter_read_bytes": quarter_read,
            "quarter_ratio": quarter_read / quarter_bound,
            "collectives": hlo.collectives(hlo.parse(compiled.as_text())),
            "prefill_flops": prefill_flops, "prefill_model_flops": model_flops,
            # the float32 logits of the device's rows: the excess over the bound in these units is the sampling's
            # passes over the vocabulary (temperature, log-softmax, the Gumbel draw's random bits)
            "logits_bytes": rows // shards * config.vocab_size * 4}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.decode_bound", description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="cpu",
                        help="cpu (8 simulated devices), a TPU topology (v5p:2x2x2) or a GPU node (h100x8)")
    parser.add_argument("--quick", action="store_true", help="2 layers of the GSM8K configs' model")
    parser.add_argument("--configs", nargs="*", default=None, help="config files (default: configs/*.yaml)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    import os

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    paths = [pathlib.Path(p) for p in args.configs] if args.configs else sorted((ROOT / "configs").glob("*.yaml"))
    from jppo.config import ConfigError

    results, skipped = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for path in paths:
            if is_sft(path):
                continue
            try:
                results.append(measure(path, args.target, args.quick, pathlib.Path(tmp)))
            except ConfigError as error:  # a config whose batch does not cut over 8 devices: said, not measured
                skipped.append({"config": path.name, "skipped": str(error)})
    if args.json:
        print(json.dumps(results + skipped, indent=1))
        return 0
    print(f"{'config':<30}{'mesh d,f,t,s':>14}{'L':>4}{'rows':>6}{'P+T':>10}{'weights MiB':>13}{'caches MiB':>12}"
          f"{'read MiB':>10}{'read/bound':>12}{'at 1/4':>8}{'excess/logits':>15}{'prefetched/bound':>18}"
          f"{'prefill/model':>15}  collectives")
    for r in results:
        mesh = ",".join(str(v) for v in r["mesh"].values())
        ops = {k: v for k, v in r["collectives"].items() if v} or "none"
        print(f"{r['config']:<30}{mesh:>14}{r['layers']:>4}{r['rows_per_device']:>6}"
              f"{str(r['prompt_width']) + '+' + str(r['slots']):>10}{r['weights_bytes'] / 2**20:>13.2f}"
              f"{r['cache_bytes'] / 2**20:>12.2f}{r['read_bytes'] / 2**20:>10.2f}{r['ratio']:>12.2f}"
              f"{r['quarter_ratio']:>8.2f}"
              f"{(r['read_bytes'] - r['bound_bytes']) / r['logits_bytes']:>15.1f}"
              f"{r['prefetch_counted_bytes'] / r['bound_bytes']:>18.2f}"
              f"{r['prefill_flops'] / r['prefill_model_flops']:>15.2f}  {ops}")
    for r in skipped:
        print(f"{r['config']:<30}  not on 8 devices: {r['skipped']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
