"""``python -m jppo.plot RUN_DIR``: PNG plots of a run's ``metrics.jsonl`` into ``RUN_DIR/plots/``
(:mod:`jppo.runlog.plot` says which)."""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from jppo import cli
from jppo.runlog import METRICS_FILE
from jppo.runlog.plot import plot_run


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = cli.parse_args(
        argv, "plot", "Plot a jppo run's metrics.jsonl.",
        lambda parser: parser.add_argument("run_dir", metavar="RUN_DIR", help=f"directory holding {METRICS_FILE}"),
    )
    try:
        paths = plot_run(args.run_dir)
    except (OSError, ValueError) as error:
        return cli.fail("plot", error)
    if not paths:
        print(f"jppo.plot: no plottable metrics in {args.run_dir}", file=sys.stderr)
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
