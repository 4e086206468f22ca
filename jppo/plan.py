"""``python -m jppo.plan --config CFG [--devices N] [--json] [key.sub=value ...]``: the memory a run needs on each
device, computed from the config and the model's shapes before anything is allocated (:mod:`jppo.run.memory`)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

from jppo import cli
from jppo.config import ConfigError, check_mesh
from jppo.run.memory import as_json, memory_plan, table


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--devices", type=int, help="plan for this many devices (default: this machine's)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


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
    except cli.INPUT_ERRORS as error:
        return cli.fail("plan", error)
    print(json.dumps(as_json(plan), indent=2) if args.json else table(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
