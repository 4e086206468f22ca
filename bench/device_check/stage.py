"""What every device-check stage shares: its command line, and one JSON file per stage that says how it went."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import pathlib
import sys
import time
import traceback
from typing import Callable, Mapping

from bench.report import finite


def write(out: pathlib.Path, stage: str, record: dict) -> pathlib.Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stage}.json"
    path.write_text(json.dumps(finite({"stage": stage, **record}), indent=2, allow_nan=False) + "\n")
    return path


def version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def device_peak_bytes() -> int | None:
    """The first device's peak bytes in use since the process started (None where JAX does not count: CPU)."""
    import jax  # noqa: PLC0415

    stats = jax.devices()[0].memory_stats()
    return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None


class OutOfTime(Exception):
    """A stage stopped by its box's SIGTERM in a way that raises rather than dies (``jppo.train`` turns the signal
    into its resume status): the stage is reported as out of time, as one the signal killed."""


def main(stages: Mapping[str, Callable[[bool, pathlib.Path], dict]], argv=None) -> int:
    """Runs one of ``stages`` (``fn(cpu, out) -> result``) and writes ``OUT/STAGE.json``: ``status`` ok with the
    result and its wall seconds, ``status`` timeout when the stage ran out of its box (:class:`OutOfTime`, exit
    124, as ``timeout`` reports it), or ``status`` error with the exception's last line and traceback (exit 1)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=sorted(stages))
    parser.add_argument("--out", required=True, help="folder of the stage's JSON file")
    parser.add_argument("--cpu", action="store_true", help="tiny shapes: a rehearsal on CPU in seconds")
    args = parser.parse_args(argv)
    out = pathlib.Path(args.out)
    started = time.perf_counter()
    try:
        result = stages[args.stage](args.cpu, out)
    except OutOfTime as stopped:
        write(out, args.stage, {"status": "timeout", "error": str(stopped), "wall_s": time.perf_counter() - started})
        print(f"device_check: {args.stage}: {stopped}", file=sys.stderr)
        return 124
    except Exception as error:  # noqa: BLE001 (a stage's failure is its report, and the next stage still runs)
        write(out, args.stage, {"status": "error", "error": f"{type(error).__name__}: {error}"[:2000],
                                "traceback": traceback.format_exc()[-6000:],
                                "wall_s": time.perf_counter() - started})
        print(f"device_check: {args.stage}: error: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    write(out, args.stage, {"status": "ok", "cpu_mode": args.cpu, "wall_s": time.perf_counter() - started, **result})
    return 0
