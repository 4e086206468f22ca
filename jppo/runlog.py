"""Run logging: ``metrics.jsonl``, TensorBoard scalars and a progress bar (or, off a terminal, summary lines).

Named ``runlog`` rather than ``logging``: a ``jppo/logging.py`` would shadow the standard library's ``logging`` for
anything run with ``jppo/`` on ``sys.path`` (``python jppo/some_script.py``), and jax, orbax and absl all import it.

Steps are numbered from 1, like verl's ``global_steps``: ``log(step, ...)`` after the ``step``-th training step.
Step 0 holds what is measured before the first step (the trainer's ``val_before_train``, which verl also logs at
global step 0). ``start_step`` is the first step a run will log (0 for a fresh run, ``checkpoint step + 1`` on
resume); any line of an earlier, interrupted run with ``step >= start_step`` is dropped when the logger opens, and
TensorBoard is told to hide that run's events from ``start_step`` on, so each step is shown once.

``metrics.jsonl`` holds one JSON object per line, ``{"step": 12, "actor/pg_loss": -0.01, ...}``, flushed as it is
written. NaN and infinities are not valid JSON; they are written as ``null`` (TensorBoard still gets the float).
"""

from __future__ import annotations

import json
import math
import operator
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Mapping, TextIO

from tqdm import tqdm

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
# Shown next to the progress bar and in summary lines, under these short names, when a step reports them.
KEY_METRICS: dict[str, str] = {
    "reward/mean": "reward",
    "actor/pg_loss": "pg_loss",
    "critic/vf_loss": "vf_loss",
    "actor/ppo_kl": "ppo_kl",
}


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` in file order (``null`` values stay ``None``).

    A torn last line, left by a crash in the middle of a write, is skipped; any other unreadable line is an error.
    """
    path = Path(path)
    lines = path.read_text().splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        record = _parse_record(line)
        if record is None:
            if number == len(lines):
                break
            raise ValueError(f"{path}:{number} is not a JSON object with an integer 'step': {line[:80]!r}")
        records.append(record)
    return records


class RunLogger:
    """Writes each step's metrics to ``output_dir/metrics.jsonl``, TensorBoard and the terminal.

    On a terminal (``stream.isatty()``) a tqdm bar shows step/total, rate, ETA and the :data:`KEY_METRICS`;
    elsewhere (CI logs) one compact line is printed every ``summary_every`` steps, on the first step logged (and
    the first training step after step 0) and on the last. Only the main process writes: with ``is_main_process=False`` every method does nothing.
    """

    def __init__(
        self,
        output_dir: str | os.PathLike,
        *,
        total_steps: int,
        tensorboard: bool = True,
        progress_bar: bool = True,
        is_main_process: bool = True,
        start_step: int = 0,
        summary_every: int = 10,
        stream: TextIO | None = None,
    ):
        for name, value, least in (("total_steps", total_steps, 1), ("start_step", start_step, 0),
                                   ("summary_every", summary_every, 1)):
            if not isinstance(value, int) or value < least:
                raise ValueError(f"RunLogger {name}={value!r} is invalid: expected an integer >= {least}")
        self._active = is_main_process
        self._total_steps = total_steps
        self._start_step = start_step
        self._summary_every = summary_every
        self._last_step: int | None = None
        self._started = time.monotonic()
        self._file = self._tensorboard = self._bar = None
        self._stream = None
        if not self._active:
            return
        output_dir = Path(output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        metrics_path = output_dir / METRICS_FILE
        _drop_steps_from(metrics_path, start_step)
        self._file = metrics_path.open("a", encoding="utf-8")
        if tensorboard:
            # Imported here: tensorboardX imports torch and boto3 when they are installed (seconds of start-up).
            from tensorboardX import SummaryWriter

            # purge_step makes TensorBoard hide an earlier run's events from start_step on (all of them for a
            # fresh run). The suffix keeps two writers started in the same second from truncating each other's
            # file (the name has seconds).
            self._tensorboard = SummaryWriter(
                str(output_dir / TENSORBOARD_DIR), purge_step=start_step, filename_suffix=f".{uuid.uuid4().hex[:8]}",
            )
        if progress_bar:
            self._stream = stream if stream is not None else sys.stderr
            if self._stream.isatty():
                self._bar = tqdm(
                    total=total_steps, initial=max(start_step - 1, 0), file=self._stream, desc="train",
                    unit="step", dynamic_ncols=True,
                )

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Records the metrics of training step ``step`` (scalars: floats, ints, numpy or jax scalars)."""
        if not self._active:
            return
        if self._file is None:
            raise RuntimeError("RunLogger.log called after close()")
        step = self._checked_step(step)
        if "step" in metrics:
            raise ValueError(f"metric name 'step' at step {step} is reserved for the step number")
        values = {name: _scalar(name, value) for name, value in metrics.items()}
        record = {"step": step, **{name: value if math.isfinite(value) else None for name, value in values.items()}}
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        if self._tensorboard is not None:
            for name, value in values.items():
                self._tensorboard.add_scalar(name, value, step)
            self._tensorboard.flush()
        first = self._last_step in (None, 0)  # the first training step gets its line after step 0's too
        self._last_step = step
        self._show(step, values, first)

    def close(self) -> None:
        """Flushes and closes the file, the TensorBoard writer and the bar; closing twice is harmless."""
        for resource in (self._file, self._tensorboard, self._bar):
            if resource is not None:
                resource.close()
        self._file = self._tensorboard = self._bar = None

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _checked_step(self, step: Any) -> int:
        try:
            number = operator.index(step)
        except TypeError:
            number = None
        if number is None or number < self._start_step:
            raise ValueError(
                f"RunLogger.log step={step!r} is invalid: expected an integer >= start_step {self._start_step}"
            )
        if self._last_step is not None and number <= self._last_step:
            raise ValueError(f"RunLogger.log step {number} after step {self._last_step}: steps must increase")
        return number

    def _show(self, step: int, values: dict[str, float], first: bool) -> None:
        key_values = "  ".join(f"{short} {values[name]:.4g}" for name, short in KEY_METRICS.items() if name in values)
        if self._bar is not None:
            self._bar.set_postfix_str(key_values, refresh=False)
            self._bar.update(step - self._bar.n)
        elif self._stream is not None and (first or step % self._summary_every == 0 or step == self._total_steps):
            print(self._summary_line(step, key_values), file=self._stream, flush=True)

    def _summary_line(self, step: int, key_values: str) -> str:
        if step == 0:  # no training step yet: no rate, no ETA
            return " | ".join([f"step 0/{self._total_steps}", "before training"] + ([key_values] if key_values else []))
        steps_done = step - max(self._start_step - 1, 0)
        seconds_per_step = (time.monotonic() - self._started) / max(steps_done, 1)
        eta = _duration(seconds_per_step * max(self._total_steps - step, 0))
        parts = [f"step {step}/{self._total_steps}", f"{seconds_per_step:.3g} s/step", f"eta {eta}"]
        return " | ".join(parts + ([key_values] if key_values else []))


def _parse_record(line: str) -> dict[str, Any] | None:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("step"), int):
        return None
    return record


def _drop_steps_from(path: Path, start_step: int) -> None:
    """Rewrites ``path`` (atomically) without the lines of steps ``>= start_step`` and without torn lines."""
    if not path.exists():
        return
    lines = path.read_text(encoding="utf-8").splitlines()
    kept = [line for line in lines if (record := _parse_record(line)) is not None and record["step"] < start_step]
    if len(kept) == len(lines):
        return
    partial = path.with_name(path.name + ".tmp")
    partial.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    os.replace(partial, path)


def _scalar(name: str, value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"metric {name!r} is not a scalar number: {value!r}") from None


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"
