"""``python -m jppo.plan --config CFG [--devices N] [--json] [key.sub=value ...]``: the memory a run needs on each
device, computed from the config and the model's shapes before anything is allocated (:mod:`jppo.run.memory`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Mapping, Optional, Sequence

from jppo import cli
from jppo.config import ConfigError, check_mesh
from jppo.run.memory import MemoryPlan, human, memory_plan

DEFAULT_MEM_FRACTION = 0.75  # the share of a GPU's memory JAX's allocator takes unless XLA_PYTHON_CLIENT_MEM_FRACTION


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--devices", type=int, help="plan for this many devices (default: this machine's)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--device-memory", type=float, metavar="GIB",
                        help="memory of one device in GiB, to check the peak against what JAX's allocator takes of "
                             "it (default: this machine's first device, when JAX reports its limit)")


def allocator_bytes(device_bytes: int, environ: Mapping[str, str]) -> int:
    """What JAX's allocator takes of a device of ``device_bytes``: ``XLA_PYTHON_CLIENT_MEM_FRACTION`` of it (0.75
    unless set), as it preallocates on a GPU."""
    fraction = environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    try:
        share = DEFAULT_MEM_FRACTION if fraction is None else float(fraction)
    except ValueError:
        raise ConfigError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={fraction!r} must be a number in (0, 1]") from None
    return int(device_bytes * share)


def this_devices_limit() -> Optional[int]:
    """The allocator's limit on this machine's first device, as JAX reports it (None: it reports none, the CPU)."""
    import jax  # noqa: PLC0415 (only when planning for this machine)

    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


def over_limit(plan: MemoryPlan, limit: Optional[int], source: str, remat: bool = False) -> Optional[str]:
    """One warning line when the plan's peak exceeds ``limit`` bytes (what the allocator takes, from ``source``),
    suggesting only what the config has not done yet (``remat``: ``model.remat`` is already on)."""
    if limit is None or plan.peak_bytes <= limit:
        return None
    remedies = "shard more (mesh.fsdp) or cut smaller micro-batches" + (
        " (model.remat is already on)" if remat else ", or turn on model.remat")
    return (f"jppo.plan: warning: the peak of {human(plan.peak_bytes)} per device exceeds the {human(limit)} JAX's "
            f"allocator takes ({source}): expect out-of-memory; {remedies}")


def table(plan: MemoryPlan) -> str:
    mesh = " x ".join(f"{axis}={size}" for axis, size in plan.mesh.items())
    lines = [f"memory plan per device, mesh {mesh}", f"{'term':<26} {'bytes':>14} {'':>11}  formula"]
    sections = [("persistent", plan.persistent), ("rollout", plan.rollout)]
    sections += list(plan.updates.items())
    for title, terms in sections:
        lines.append(f"[{title}]")
        lines += [f"  {t.name:<24} {t.bytes:>14,} {human(t.bytes):>11}  {t.formula}" for t in terms]
        if title != "persistent":
            total = sum(t.bytes for t in terms)
            lines.append(f"  {'subtotal':<24} {total:>14,} {human(total):>11}")
    lines.append(f"{'persistent total':<26} {plan.persistent_bytes:>14,} {human(plan.persistent_bytes):>11}")
    lines.append(f"{'peak':<26} {plan.peak_bytes:>14,} {human(plan.peak_bytes):>11}  persistent + largest phase")
    return "\n".join(lines)


def as_json(plan: MemoryPlan) -> dict:
    phases = {"persistent": plan.persistent, "rollout": plan.rollout, **plan.updates}
    return {
        "mesh": plan.mesh, "persistent_bytes": plan.persistent_bytes, "peak_bytes": plan.peak_bytes,
        "terms": {t.name: t.bytes for terms in phases.values() for t in terms},
    }


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    return cli.parse_args(argv, "plan", "Per-device memory of a training run.", options,
                          overrides="key.sub=value overrides, e.g. mesh.fsdp=8")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        cfg = cli.load_config(args)
        if args.devices is not None and args.devices < 1:
            raise ConfigError(f"--devices={args.devices} must be >= 1")
        if args.devices is None:
            import jax  # noqa: PLC0415 (only to count this machine's devices)

            args.devices = jax.device_count()
        plan = memory_plan(cfg, check_mesh(cfg, args.devices))
        if args.device_memory is not None:
            if args.device_memory <= 0:
                raise ConfigError(f"--device-memory={args.device_memory} must be > 0 (GiB)")
            limit = allocator_bytes(int(args.device_memory * 2**30), os.environ)
            fraction = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", DEFAULT_MEM_FRACTION)
            source = f"{fraction} of --device-memory={args.device_memory:g} GiB, XLA_PYTHON_CLIENT_MEM_FRACTION"
        else:
            limit, source = this_devices_limit(), "this machine's device"
    except cli.INPUT_ERRORS as error:
        return cli.fail("plan", error)
    print(json.dumps(as_json(plan) | {"allocator_bytes": limit}, indent=2) if args.json else table(plan))
    warning = over_limit(plan, limit, source, remat=cfg.model.remat)
    if warning:
        print(warning, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
