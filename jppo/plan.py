"""``python -m jppo.plan --config CFG [--devices N] [--json] [key.sub=value ...]``: the memory a run needs on each
device, computed from the config and the model's shapes before anything is allocated (:mod:`jppo.preflight.memory`).

``--compile-for TARGET`` compiles every program of the run for a TPU slice or GPU nodes on this machine, with no
accelerator, weight or data file (:mod:`jppo.preflight.compiled`), and prints per program XLA's bytes per device beside
the plan's, its collectives and its flops; exit status 1 when a program does not compile or does not fit.

A config that sets the ``sft`` section is ``python -m jppo.sft``'s: its plan is the SFT update's
(:mod:`jppo.preflight.sft_memory`), on the mesh that command makes."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

from jppo import cli
from jppo.config import ConfigError, check_mesh
from jppo.config.applies import sets_sft
from jppo.preflight import fit
from jppo.preflight.footprint import human
from jppo.preflight.memory import MemoryPlan


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--devices", type=int, help="plan for this many devices (default: this machine's)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--compile-for", metavar="TARGET",
                        help="compile every program of the run for TARGET's compile-only devices: a TPU topology as "
                             "libtpu names it (v5p:2x2x2, v6e:4x4) or GPU nodes h100x8, h200x8, h200x8x2 (nodes)")
    parser.add_argument("--device-memory", type=float, metavar="GIB",
                        help="memory of one device in GiB, to check the peak against what JAX's allocator takes of "
                             "it (default: this machine's first device, when JAX reports its limit)")


def table(plan: MemoryPlan) -> str:
    mesh = " x ".join(f"{axis}={size}" for axis, size in plan.mesh.items())
    lines = [f"memory plan per device, mesh {mesh}", f"{'term':<26} {'bytes':>14} {'':>11}  formula"]
    sections = [("persistent", plan.persistent)]
    sections += [("each step", plan.in_flight)] if plan.in_flight else []
    sections += [("rollout", plan.rollout)] + ([("validation", plan.validation)] if plan.validation else [])
    sections += list(plan.updates.items())
    for title, terms in sections:
        if not terms:  # a mesh of one side of rollout.devices: the other side's phases are elsewhere
            continue
        lines.append(f"[{title}]")
        lines += [f"  {t.name:<24} {t.bytes:>14,} {human(t.bytes):>11}  {t.formula}" for t in terms]
        if title not in ("persistent", "each step"):
            total = sum(t.bytes for t in terms)
            lines.append(f"  {'subtotal':<24} {total:>14,} {human(total):>11}")
    lines.append(f"{'persistent total':<26} {plan.persistent_bytes:>14,} {human(plan.persistent_bytes):>11}")
    phase = "rollout + largest update phase (sampled beside the update)" if plan.concurrent else "largest phase"
    each = " + each step" if plan.in_flight else ""
    lines.append(f"{'peak':<26} {plan.peak_bytes:>14,} {human(plan.peak_bytes):>11}  persistent{each} + {phase}")
    return "\n".join(lines)


def as_json(plan: MemoryPlan) -> dict:
    phases = {"persistent": plan.persistent, "each step": plan.in_flight, "rollout": plan.rollout,
              "validation": plan.validation, **plan.updates}
    return {
        "mesh": plan.mesh, "persistent_bytes": plan.persistent_bytes, "peak_bytes": plan.peak_bytes,
        "terms": {t.name: t.bytes for terms in phases.values() for t in terms},
        "phase_bytes": {name: sum(t.bytes for t in terms) for name, terms in phases.items()},
    }


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    return cli.parse_args(argv, "plan", "Per-device memory of a training run.", options,
                          overrides="key.sub=value overrides, e.g. mesh.fsdp=8")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.compile_for is not None:
        return compile_for(args)
    try:
        cfg = cli.load_config(args, data_files=False)  # shapes only: the prompt files need not be on this machine
        if args.devices is not None and args.devices < 1:
            raise ConfigError(f"--devices={args.devices} must be >= 1")
        if args.devices is None:
            import jax  # noqa: PLC0415 (only to count this machine's devices)

            args.devices = jax.device_count()
        plans = (fit.sft_plans(cfg, args.devices) if sets_sft(cfg)
                 else fit.mesh_plans(cfg, check_mesh(cfg, args.devices)))
        if args.device_memory is not None:
            if args.device_memory <= 0:
                raise ConfigError(f"--device-memory={args.device_memory} must be > 0 (GiB)")
            limit = fit.allocator_bytes(int(args.device_memory * 2**30), os.environ)
            fraction = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", fit.DEFAULT_MEM_FRACTION)
            source = f"{fraction} of --device-memory={args.device_memory:g} GiB, XLA_PYTHON_CLIENT_MEM_FRACTION"
        else:
            limit, source = fit.this_devices_limit(), "this machine's device"
    except cli.INPUT_ERRORS as error:
        return cli.fail("plan", error)
    plan, rollout = plans
    if args.json:
        extra = {} if rollout is None else {"rollout_mesh": as_json(rollout)}
        print(json.dumps(as_json(plan) | extra | {"allocator_bytes": limit}, indent=2))
    elif rollout is None:
        print(table(plan))
    else:
        print(f"training mesh (the first devices)\n{table(plan)}\n\n"
              f"rollout mesh (the last rollout.devices={cfg.rollout.devices})\n{table(rollout)}")
    for each in plans:
        warning = each is not None and fit.over_limit(each, limit, source, remat=cfg.model.remat)
        if warning:
            print(warning, file=sys.stderr)
    return 0


def compile_for(args: argparse.Namespace) -> int:
    """``--compile-for TARGET``: every program compiled for the target; 0 when all compile and fit, else 1."""
    import jax  # noqa: PLC0415

    if not os.environ.get("JAX_PLATFORMS"):  # the host's CPU only: the target's devices are described, not opened
        jax.config.update("jax_platforms", "cpu")
    try:
        if args.devices is not None or args.device_memory is not None:
            raise ConfigError("--compile-for takes its devices and their memory from TARGET: leave out --devices "
                              "and --device-memory")
        cfg = cli.load_config(args, data_files=False)
        if sets_sft(cfg):
            raise ConfigError("--compile-for compiles the programs of an RL run; this config sets the sft section "
                              "(python -m jppo.sft's): plan it without --compile-for")
        report = fit.compiled_report(cfg, args.compile_for, os.environ)
    except cli.INPUT_ERRORS as error:
        return cli.fail("plan", error)
    print(json.dumps(report, indent=2) if args.json else compiled_table(report))
    fails = [p["name"] for p in report["programs"] if not p["compiled"] or not p["fits"]]
    if fails:
        print(f"jppo.plan: {', '.join(fails)}: did not compile or does not fit {args.compile_for}", file=sys.stderr)
    return 1 if fails else 0


def compiled_table(report: dict) -> str:
    mesh = " x ".join(f"{axis}={size}" for axis, size in report["mesh"].items())
    memory = "unknown" if report["device_memory"] is None else human(report["device_memory"])
    if "rollout_mesh" in report:  # rollout.devices: the sampler's programs on a mesh of their own
        n, hosts = report["rollout_mesh"]["data"], report["hosts"]
        where = f"the last {n} devices" if hosts == 1 else f"{n} devices, the last {n // hosts} of each host"
        mesh += f" (the rollout's programs on {where}, data)"
    lines = [f"compiled for {report['target']}: {report['devices']} devices on {report['hosts']} hosts, mesh {mesh}, "
             f"{memory} per device",
             f"{'program':<14} {'compiled':<9} {'XLA':>11} {'plan':>11} {'peak':>11}  {'flops':>9}  collectives"]
    ops = lambda counts: ", ".join(f"{n} {op}" for op, n in counts.items()) or "none"  # noqa: E731
    for p in report["programs"]:
        if not p["compiled"]:
            lines.append(f"{p['name']:<14} {'no':<9} {p['error']}")
            continue
        plan = "" if p["plan_bytes"] is None else human(p["plan_bytes"])
        flops = "?" if p["flops"] is None else f"{p['flops']:.3g}"
        fit = "" if p["fits"] else "  DOES NOT FIT"
        lines.append(f"{p['name']:<14} {'yes':<9} {human(p['xla_bytes']):>11} {plan:>11} {human(p['peak_bytes']):>11}"
                     f"  {flops:>9}  {ops(p['collectives'])}{fit}")
        if p["hbm_bytes"] is not None:
            lines.append(f"{'':<14} in HBM by XLA's buffer assignment: {human(p['hbm_bytes'])}")
        if p["decode_step_collectives"] is not None:
            lines.append(f"{'':<14} per decoded token: {ops(p['decode_step_collectives'])}")
    lines.append("XLA: arguments + outputs - donated + temporaries per device; plan: python -m jppo.plan's figure for "
                 "the phase; peak: XLA's plus the run's other resident arrays; flops: matrix products per device, "
                 "loops multiplied out (decoding at its longest)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
