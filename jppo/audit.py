"""``python -m jppo.audit --config CFG [key.sub=value ...]``: does this configuration keep the contract?

The audit of :mod:`jppo.preflight.audit` (which says what it compares and prints, and when a row is decided in float64);
the exit status is 0 within tolerance, 1 outside it, 2 for a bad setting (one line on stderr, found before or while
the audit runs).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Optional, Sequence

from jppo import cli
from jppo.config.applies import sets_sft
from jppo.parallel import distributed
from jppo.preflight.audit import FLOAT64_TOLERANCE, audit, audit_sft, tolerance_of
from jppo.run import build, sft


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="fewer meshes: data-parallel, one 3-D mesh and one context-parallel mesh")
    parser.add_argument("--meshes", metavar="DxFxTxS[xE],...",
                        help="audit these mesh shapes (data x fsdp x tensor x sequence [x expert]) only, e.g. "
                             "1x1x1x1,2x2x2x1,2x2x1x1x2; "
                             "a one-device shape runs every cut, the others the finest")
    parser.add_argument("--float64", action="store_true",
                        help="every row in float64 (jax_enable_x64), within %g: a dependence on the cut smaller "
                             "than float32's rounding shows too" % FLOAT64_TOLERANCE)
    parser.add_argument("--sft", action="store_true",
                        help="audit python -m jppo.sft's update of this config (its first sft.batch_size rows); the "
                             "default for a config that sets the sft section")


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    return cli.parse_args(
        argv, "audit", __doc__.split("\n\n")[0],
        options,
        overrides="key.sub=value overrides", processes=True,
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    try:  # a bad setting found while building or running the updates is a one-line error too, not a traceback
        cfg = cli.load_config(args, sft=args.sft or None)
        args.sft = args.sft or sets_sft(cfg)  # an SFT config audits its SFT update
        quiet = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, val_every=0, val_before_train=False))
        if args.sft:
            cfg = sft.sft_config(quiet)
            inputs = sft.load_inputs(cfg)
            distributed.initialize(args)
            worst = audit_sft(cfg, inputs, quick=args.quick, meshes=args.meshes, float64=args.float64)
        else:
            cli.start("audit", cfg, args)  # the processes of a pod first, as train and eval start them
            worst = audit(cfg, build.load_inputs(quiet), quick=args.quick, meshes=args.meshes, float64=args.float64)
    except cli.START_ERRORS as error:
        return cli.fail("audit", error)
    tolerance = tolerance_of(cfg, args.float64)
    passed = worst.passes()
    if cfg.trainer.deterministic == "bitwise" and not args.sft:
        print(f"jppo.audit: {'exact' if passed else 'NOT EXACT'} (trainer.deterministic=bitwise: every row bit for "
              f"bit), {worst.outside} rows not exact ({time.perf_counter() - started:.0f} s)")
    else:
        print(f"jppo.audit: {'within' if passed else 'OUTSIDE'} tolerance ({tolerance:g}"
              + ("" if args.float64 else f"; in float64 {FLOAT64_TOLERANCE:g}") + f"), {worst.outside} rows outside "
              f"({time.perf_counter() - started:.0f} s)")
    if worst.rechecked:
        print(f"decided in float64: {worst.rechecked} rows, largest difference there {worst.float64:.3e}")
    print(f"max_rel_first_step_grad_diff={worst.first_step:.3e}")
    print(f"max_rel_grad_diff={worst.gradient:.3e}")
    print(f"max_rel_metric_diff={worst.metric:.3e}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
