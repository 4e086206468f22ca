"""End to end: seconds per training step of ``configs/quickstart.yaml``, split by phase, and time to target reward.

    python -m bench.end_to_end [--quick] [--run-dir DIR] [--set key.sub=value ...]

Runs ``jppo.run.loop.run`` in this process on a fresh output directory and reads back what the trainer itself
measures, ``timing/<phase>`` per step in ``metrics.jsonl`` (rollout, reward, old_log_prob, values, advantages,
update_critic, update_actor). Two things the trainer does not time are observed from outside, by handing
``run`` a :class:`~jppo.runlog.RunLogger` subclass that notes the clock around each ``log`` call: the logging
phase (metrics.jsonl, TensorBoard, progress line) and the wall-clock time at which each step was done, which is
what a user waits for (start-up, compilation, validation and checkpoints included).

Per-phase seconds are medians over the steps after the first (the first compiles everything; it is reported
apart). ``other`` is the rest of the time between two logged steps: validation and checkpoint steps, host work
between the timed phases. Time to target is the first step whose ``reward/mean`` reaches ``TARGET_REWARD``, and
the wall-clock seconds from the call of ``run`` to the moment that step was logged. The full mode runs the config
as it is (every step, validation, checkpoints); ``--quick`` runs ``QUICK_STEPS`` steps without validation,
checkpoints between steps, TensorBoard or plots, and reports whether the target was reached within them.
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Mapping, Sequence
from unittest import mock

import jax

from bench.report import section
from jppo.config import ConfigError, check_mesh, load_config
from jppo.run import build, lifecycle, loop
from jppo.runlog import METRICS_FILE, RunLogger, read_metrics

QUICKSTART = pathlib.Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
TARGET_REWARD = 0.9
QUICK_STEPS = 3
# the trainer's phases in the order a step runs them (a phase missing here is listed after these)
PHASE_ORDER = (
    "rollout", "reward", "old_log_prob", "ref_log_prob", "values", "advantages", "update_critic", "update_actor"
)
QUICK_OVERRIDES = (
    f"trainer.total_steps={QUICK_STEPS}", "trainer.val_every=0", "trainer.save_every=0",
    "trainer.logger=[console,jsonl]", "trainer.plots=false",
)


def _timed_logger(marks: list[tuple[int, float, float]]) -> type[RunLogger]:
    class TimedRunLogger(RunLogger):
        """Notes ``(step, clock before log, clock after log)`` for every step logged."""

        def log(self, step: int, metrics: Mapping[str, Any]) -> None:
            start = time.perf_counter()
            super().log(step, metrics)
            marks.append((step, start, time.perf_counter()))

    return TimedRunLogger


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def run_overrides(out: str | pathlib.Path, quick: bool, extra_overrides: Sequence[str]) -> list[str]:
    return [f"trainer.output_dir={out}", "trainer.resume=never", *(QUICK_OVERRIDES if quick else ()), *extra_overrides]


def check_overrides(quick: bool, extra_overrides: Sequence[str], config: str | pathlib.Path = QUICKSTART) -> None:
    """Validates the run's config as the trainer's CLI does, before any benchmark runs: a bad ``--set`` is a
    :class:`~jppo.config.ConfigError` in one line, not a traceback after minutes of other measurements."""
    with tempfile.TemporaryDirectory() as scratch:
        check_mesh(load_config(config, run_overrides(pathlib.Path(scratch) / "run", quick, extra_overrides)),
                   jax.device_count())


def measure(
    quick: bool,
    run_dir: str | pathlib.Path | None = None,
    config: str | pathlib.Path = QUICKSTART,
    extra_overrides: Sequence[str] = (),
) -> dict:
    """Per-phase seconds per step and time to target of one in-process training run (see the module docstring).
    ``run_dir``: where the run writes (emptied first); a temporary directory by default. ``extra_overrides``
    (``key.sub=value``) apply last, e.g. ``trainer.total_steps=300`` to look for the target beyond the config's
    own length."""
    with tempfile.TemporaryDirectory() as scratch:
        out = pathlib.Path(run_dir) if run_dir is not None else pathlib.Path(scratch) / "run"
        shutil.rmtree(out, ignore_errors=True)
        overrides = run_overrides(out, quick, extra_overrides)
        cfg = load_config(config, overrides)
        mesh_shape = check_mesh(cfg, jax.device_count())
        marks: list[tuple[int, float, float]] = []
        started = time.perf_counter()
        inputs = build.load_inputs(cfg)
        with mock.patch.object(lifecycle, "RunLogger", _timed_logger(marks)):
            loop.run(cfg, mesh_shape, inputs)
        total_s = time.perf_counter() - started
        records = [record for record in read_metrics(out / METRICS_FILE) if record["step"] >= 1]
    return summarize(records, marks, started, total_s, quick, str(config), list(overrides))


def summarize(
    records: list[dict], marks: list[tuple[int, float, float]], started: float, total_s: float, quick: bool,
    config: str, overrides: list[str],
) -> dict:
    logged = {step: (before, after) for step, before, after in marks}
    found = {name.removeprefix("timing/") for record in records for name in record if name.startswith("timing/")}
    order = {name: index for index, name in enumerate(PHASE_ORDER)}
    phases = ["timing/" + name for name in sorted(found, key=lambda name: (order.get(name, len(order)), name))]
    later = [record for record in records if record["step"] >= 2]
    per_phase = {
        name.removeprefix("timing/"): _median([r[name] for r in later if r.get(name) is not None]) for name in phases
    }
    logging_s = {step: after - before for step, (before, after) in logged.items()}
    per_phase["logging"] = _median([logging_s[r["step"]] for r in later if r["step"] in logged])
    # the time between the end of one step's logging and the end of the next one's, less what is accounted for
    intervals = [
        logged[r["step"]][1] - logged[r["step"] - 1][1] - r["timing/step"] - logging_s[r["step"]]
        for r in later if r["step"] in logged and r["step"] - 1 in logged
    ]
    per_phase["other"] = _median(intervals)
    target = next((r for r in records if (r.get("reward/mean") or 0.0) >= TARGET_REWARD), None)
    time_to_target = {
        "target_reward": TARGET_REWARD,
        "reached": target is not None,
        "steps_run": len(records),
        "best_reward": max((r.get("reward/mean") or 0.0) for r in records),
    }
    if target is not None:
        step = target["step"]
        time_to_target |= {
            "step": step,
            "wall_s": logged[step][1] - started,
            "train_step_s": sum(r["timing/step"] for r in records if r["step"] <= step),
        }
    return {
        "config": config,
        "overrides": overrides,
        "mode": "quick" if quick else "full",
        "steps": len(records),
        "first_step_s": records[0]["timing/step"],
        "seconds_per_step": per_phase.pop("step"),
        "phases_s": per_phase,
        "run_wall_s": total_s,
        "time_to_target": time_to_target,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.end_to_end", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_STEPS} steps, no validation (CI smoke run)")
    parser.add_argument("--run-dir", help="keep the run's output here (default: a temporary directory)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="config override applied last (repeatable)"
    )
    args = parser.parse_args(argv)
    try:
        check_overrides(args.quick, args.set)
    except ConfigError as error:
        print(f"bench.end_to_end: error: --set: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    print(section("end_to_end", measure(args.quick, args.run_dir, extra_overrides=args.set)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
