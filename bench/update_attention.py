"""The actor update's attention at the GSM8K configs' real shape, compiled for a TPU slice or a GPU node: its
activations against the packed row's length, and its matrix-product flops against the model's.

    python -m bench.update_attention [--target v5p:2x2x2] [--configs configs/...yaml ...]
                                     [--lengths 4096 8192 16384] [--attention reference auto] [--json]

For each config, ``model.attention`` value and ``actor.ppo_max_token_len`` (tokens per packed row), the actor's
update is compiled for the target with the whole row on one device (``mesh.sequence=1``, the other devices over
``fsdp``), as :mod:`jppo.preflight.compiled` compiles it for ``python -m jppo.plan --compile-for`` (the GSM8K
configs take Qwen2.5-0.5B's shape, :func:`bench.decode_bound.load`). Printed per program:

- ``temp GiB``: XLA's temporaries per device (``memory_analysis().temp_size_in_bytes``: the activations a backward
  pass keeps and its scratch, beside what does not grow with the row: the LM head's table and gradient, the
  optimizer step's); ``MiB/1k``: their growth per 1,024 more tokens a row since the next shorter length (the same
  at every length: linear in the row; dense ``[T, T]`` scores double it with each doubling); ``plan GiB``: the plan's
  ``activations/actor`` term for the same run; ``plan/XLA``: the plan's bytes of the whole program (arguments,
  outputs, temporaries) over XLA's;
- ``flops/model``: the program's matrix-product flops per device (:func:`jppo.preflight.hlo.flops`, loops times
  their trip counts) over the model's, ``6 N`` per token (``N``: the weights a token multiplies, the LM head
  included, the embedding lookup not; a mixture of experts counts its routed experts) plus the causal attention
  within each packed sequence, ``6 L H E`` per token and visible key. Activation recomputation (``model.remat``)
  adds a forward pass, 8/6 of ``6 N``. The attention of a Pallas kernel (``pallas``: splash attention on a TPU,
  Triton's flash kernel on a GPU) is opaque to the count: ``kernel`` says so, and its flops are then those of the
  rest of the step;
- ``row/model``: the attention the program's algorithm computes over the model's: a packed row is several
  sequences, each seeing its own earlier tokens, and dense scores compute the whole ``[T, T]``; a causal kernel
  (splash, Triton) computes the blocks on and below the diagonal, other sequences' included. ``blockwise`` skips
  the block pairs no query sees on a TPU (not counted here: a conditional counts as its costliest branch).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = ("configs/qwen2_5_0_5b_gsm8k_grpo.yaml", "configs/qwen2_5_0_5b_gsm8k_ppo.yaml")
LENGTHS = (4096, 8192, 16384)


def weights_per_token(m) -> int:
    """``N``: the weights one token multiplies in a forward pass of the model ``m`` (a ModelConfig): every layer's
    projections (a mixture of experts' router and its ``num_experts_per_tok`` experts) and the LM head."""
    d, e = m.hidden_size, m.head_dim
    attention = d * e * (2 * m.num_heads + 2 * m.num_kv_heads)
    dense_mlp = 3 * d * m.intermediate_size
    moe_mlp = d * m.num_experts + m.num_experts_per_tok * 3 * d * m.moe_intermediate_size
    moe_layers = [i for i in range(m.num_layers) if m.num_experts and i not in m.mlp_only_layers
                  and (i + 1) % m.decoder_sparse_step == 0]
    mlp = len(moe_layers) * moe_mlp + (m.num_layers - len(moe_layers)) * dense_mlp
    return m.num_layers * attention + mlp + m.vocab_size * d


def attention_flops_per_pair(m) -> int:
    """Training flops of one (query, visible key) pair over all layers: ``q k`` and ``p v`` (2 products of ``E``
    per head, 2 flops each), forward and backward (3x)."""
    return 3 * 2 * 2 * m.num_layers * m.num_heads * m.head_dim


def measure(path: pathlib.Path, target_name: str, attention: str, length: int, tmp: pathlib.Path) -> dict:
    from bench.decode_bound import load
    from jppo.config import check_mesh
    from jppo.parallel.mesh import make_mesh
    from jppo.preflight import compiled, targets
    from jppo.preflight.footprint import model_config
    from jppo.preflight.memory import memory_plan, program_bytes
    from jppo.preflight.sampler_memory import prompt_width

    cfg = load(path, tmp, False, (f"model.attention={attention}", "mesh.sequence=1",
                                  f"actor.ppo_max_token_len={length}"))
    target = targets.target(target_name)
    shape = check_mesh(cfg, len(target.devices), target.hosts)
    batch = compiled.update_batch(cfg, "actor", make_mesh(*shape, devices=target.devices))
    ids = batch.input_ids.shape  # [steps, micro-batches, shards, rows, width]
    rows = ids[0] * ids[1] * ids[3]  # packed rows per device
    sequence = prompt_width(cfg) + cfg.rollout.max_response_length
    per_row = length // sequence
    m = model_config(cfg)
    tokens = rows * length
    pairs = rows * per_row * sequence * (sequence + 1) // 2  # each sequence's causal pairs (full-length sequences)
    model = 6 * weights_per_token(m) * tokens + attention_flops_per_pair(m) * pairs
    (program,) = compiled.compile_run(cfg, target, only=("actor_update",))
    if not program.compiled:
        return {"config": path.name, "attention": attention, "length": length, "error": program.error}
    from jppo.models.layers import resolve_attention

    chosen = resolve_attention(attention, m.compute_dtype, target.platform, length)
    computed = rows * (length * length if chosen in ("reference", "xla", "blockwise") else length * (length + 1) // 2)
    plan = memory_plan(cfg, shape, target.platform).term("activations/actor")
    planned = program_bytes(cfg, shape, target.platform)["actor_update"]
    return {"config": path.name, "target": target.name, "attention": attention, "runs": chosen, "length": length,
            "rows_per_device": rows, "sequences_per_row": per_row, "temp_bytes": program.temp_bytes,
                        "plan_activations_bytes": plan, "xla_bytes": program.xla_bytes, "plan_bytes": planned,
            "flops": program.flops, "model_flops": model,
            "kernel": chosen in ("pallas", "cudnn"), "row_over_model_attention": computed / pairs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.update_attention", description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="v5p:2x2x2", help="a TPU topology (v5p:2x2x2) or a GPU node (h100x8)")
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS))
    parser.add_argument("--lengths", nargs="*", type=int, default=list(LENGTHS))
    parser.add_argument("--attention", nargs="*", default=["reference", "auto"])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for config in args.configs:
            for attention in args.attention:
                for length in sorted(args.lengths):
                    results.append(measure(ROOT / config, args.target, attention, length, pathlib.Path(tmp)))
                    if not args.json:
                        print(json.dumps(results[-1]), flush=True)
    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    print(table(results))
    return 0


def table(results: list[dict]) -> str:
    lines = [f"{'config':<30}{'attention':>10}{'runs':>10}{'length':>8}{'rows':>6}{'temp GiB':>10}{'MiB/1k':>8}"
          f"{'plan GiB':>10}{'plan/XLA':>10}{'flops/model':>13}{'row/model':>11}"]
    shorter = {}
    for r in results:
        if "error" in r:
            lines.append(f"{r['config']:<30}{r['attention']:>10}{r['length']:>8}  did not compile: {r['error']}")
            continue
        before = shorter.get((r["config"], r["attention"]))
        shorter[(r["config"], r["attention"])] = r
        growth = "" if before is None else (
            f"{(r['temp_bytes'] - before['temp_bytes']) / 2**20 / ((r['length'] - before['length']) / 1024):.0f}")
        kernel = " kernel" if r["kernel"] else ""
        lines.append(f"{r['config']:<30}{r['attention']:>10}{r['runs']:>10}{r['length']:>8}{r['rows_per_device']:>6}"
              f"{r['temp_bytes'] / 2**30:>10.2f}{growth:>8}{r['plan_activations_bytes'] / 2**30:>10.2f}"
              f"{r['plan_bytes'] / r['xla_bytes']:>10.2f}"
              f"{r['flops'] / r['model_flops']:>13.2f}{r['row_over_model_attention']:>11.2f}{kernel}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
