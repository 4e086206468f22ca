"""The experts' work per device against the expert axis, read off the actor's update compiled for a TPU slice.

    python -m bench.expert_flops [--target v5p:2x2x2] [--experts 1 2 4 8] [--json]

quickstart_moe widened so that the experts dominate (every layer with experts, d 256, F_e 512, 8 experts, k = 8;
rows of 256 tokens with splash attention), its update compiled for the target with ``mesh.expert`` = e and
``mesh.data`` = devices / e, the global batch fixed. Per device and update, printed:

- ``rows``: the rows of a layer's grouped products (``jax.lax.ragged_dot``, XLA:TPU's Mosaic kernel): the ``e n k``
  (token, expert) pairs of the group's gathered tokens, ``n`` the device's own tokens;
- ``grouped GF``: the grouped products' flops counted for every row of their buffers
  (:func:`jppo.preflight.hlo.flops`), the layer scan and the micro-batches multiplied out;
- ``local GF``: the same for the rows of the device's own ``E / e`` experts only, ``1 / e`` of the buffer under
  uniform routing: the kernel's grid is the number of row tiles its metadata counts from the group sizes (a
  dynamic ``s32[1]``), so rows in no local group are not multiplied, at most one partial tile per group is;
- ``weights MiB``: the experts' weights a device holds (``1 / e`` of them).

The buffer grows as ``e`` (the exchange gathers the group's tokens); the multiplied rows stay ``n k`` per device,
``1 / e`` of the group's pairs, and the weights fall as ``1 / e``.
"""

from __future__ import annotations

import argparse
import json
import os

# quickstart_moe widened so that the experts outweigh the rest (tests/test_compile_for.py plans these rows too)
EXPERTS = ["model.mlp_only_layers=[]", "model.hidden_size=256", "model.intermediate_size=8",
           "model.moe_intermediate_size=512", "model.attention=auto", "data.train_batch_size=8",
           "actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size=8", "data.max_prompt_length=128",
           "rollout.prompt_bucket=128", "rollout.max_response_length=128", "trainer.val_every=0"]


def measure(target_name: str, e: int) -> dict:
    from jppo.config import check_mesh, load_config
    from jppo.parallel.mesh import make_mesh
    from jppo.preflight import compiled, hlo, targets

    target = targets.target(target_name)
    devices = len(target.devices)
    cfg = load_config("configs/quickstart_moe.yaml", [*EXPERTS, "model.num_experts_per_tok=8",
                                                      f"mesh.data={devices // e}", f"mesh.expert={e}"],
                      data_files=False)
    mesh = make_mesh(*check_mesh(cfg, devices, target.hosts), devices=target.devices)
    lower, _, _ = compiled.lowerings(cfg, mesh)
    with compiled.without_persistent_cache():
        text = lower["actor_update"]().compile().as_text()
    module = hlo.parse(text)
    grouped = [i for c in module.computations.values() for i in c
               if i.opcode == "custom-call" and "ragged_dot_tiling=" in i.attributes]
    rows = max(hlo.dims(i.shape)[0] for i in grouped)
    total = hlo.flops(module)
    without = hlo.flops(hlo.parse(text.replace("ragged_dot_tiling=", "tiling=")))  # the same, grouped products unread
    m = cfg.model
    weights = 3 * m.num_experts // e * m.hidden_size * m.moe_intermediate_size * m.num_layers * 4  # float32
    return {"expert": e, "data": devices // e, "rows": rows, "grouped_flops": total - without,
            "local_flops": (total - without) / e, "other_flops": without, "weights_bytes": weights}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.expert_flops", description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="v5p:2x2x2", help="a TPU topology libtpu compiles for")
    parser.add_argument("--experts", nargs="*", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    rows = [measure(args.target, e) for e in args.experts]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"update of quickstart_moe widened (d 256, F_e 512, 8 experts, k = 8) on {args.target}, per device")
    print(f"{'expert':>6} {'data':>5} {'rows':>7} {'grouped GF':>11} {'local GF':>9} {'other GF':>9} "
          f"{'weights MiB':>12}")
    for r in rows:
        print(f"{r['expert']:>6} {r['data']:>5} {r['rows']:>7} {r['grouped_flops'] / 1e9:>11.1f} "
              f"{r['local_flops'] / 1e9:>9.1f} {r['other_flops'] / 1e9:>9.1f} {r['weights_bytes'] / 2**20:>12.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
