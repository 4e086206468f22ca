"""Run logging through pluggable sinks: the terminal, ``metrics.jsonl``, TensorBoard and Weights & Biases.

:class:`RunLogger` checks each step's metrics once and hands them to the sinks the run selects
(``trainer.logger``, names in :data:`SINKS`): ``console`` (a progress bar, or off a terminal summary lines),
``jsonl`` (``metrics.jsonl``, and the sampled validation responses in ``generations/step_N.jsonl``), ``tensorboard``
(scalars in ``tensorboard/``) and ``wandb`` (a run of ``project_name`` / ``experiment_name``, with a table of the
sampled responses; the optional ``wandb`` package). A sink is any object with ``log(step, values)``,
``log_generations(step, records)`` and ``close()``.

Named ``runlog`` rather than ``logging``: a ``jppo/logging.py`` would shadow the standard library's ``logging`` for
anything run with ``jppo/`` on ``sys.path`` (``python jppo/some_script.py``), and jax, orbax and absl all import it.

Steps are numbered from 1, like verl's ``global_steps``: ``log(step, ...)`` after the ``step``-th training step.
Step 0 holds what is measured before the first step (the trainer's ``val_before_train``, which verl also logs at
global step 0). ``start_step`` is the first step a run will log (0 for a fresh run, ``checkpoint step + 1`` on
resume); any line of an earlier, interrupted run with ``step >= start_step`` is dropped when the logger opens, and
TensorBoard is told to hide that run's events from ``start_step`` on, so each step is shown once.

``metrics.jsonl`` holds one JSON object per line, ``{"step": 12, "actor/pg_loss": -0.01, ...}``, flushed as it is
written. NaN and infinities are not valid JSON; they are written as ``null`` (TensorBoard still gets the float).

``output_dir`` may be a cloud URI (``gs://bucket/run``). Objects there cannot be appended to, and TensorBoard's
writer only writes local files, so the sinks then write into a local staging folder and, after every logged step
and on close, the logger copies each staged file that changed (``metrics.jsonl``, ``generations/step_N.jsonl``,
the event files, ``wandb_run_id``) over the object of the same name; wandb's own ``wandb/`` folder stays local
(wandb syncs it itself). A resumed run first copies down the files the sinks resume from (:data:`RESUMED_FILES`).
"""

from __future__ import annotations

import json
import math
import operator
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Mapping, Sequence, TextIO

from tqdm import tqdm

from jppo.core.paths import is_remote, run_path

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
GENERATIONS_DIR = "generations"
WANDB_ID_FILE = "wandb_run_id"  # the wandb run a resumed run continues
SINKS = ("console", "jsonl", "tensorboard", "wandb")
RESUMED_FILES = (METRICS_FILE, WANDB_ID_FILE)  # what a sink reads back when a run resumes
WANDB_FILES_DIR = "wandb"  # wandb's local files (when WANDB_DIR is unset), synced by wandb, not copied
DEFAULT_SINKS = ("console", "jsonl", "tensorboard")
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
    path = run_path(path)
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
    """Checks each step's metrics and writes them to the selected sinks (:data:`SINKS`) under ``output_dir``.

    Only the main process writes: with ``is_main_process=False`` every method does nothing (and nothing is
    created). ``config`` is what the wandb run records as its configuration; ``project_name`` and
    ``experiment_name`` (default: the output directory's name) name that run.
    """

    def __init__(
        self,
        output_dir: str | os.PathLike,
        *,
        total_steps: int,
        sinks: Sequence[str] = DEFAULT_SINKS,
        progress_bar: bool = True,
        is_main_process: bool = True,
        start_step: int = 0,
        summary_every: int = 10,
        stream: TextIO | None = None,
        project_name: str = "jppo",
        experiment_name: str | None = None,
        config: Mapping[str, Any] | None = None,
    ):
        for name, value, least in (("total_steps", total_steps, 1), ("start_step", start_step, 0),
                                   ("summary_every", summary_every, 1)):
            if not isinstance(value, int) or value < least:
                raise ValueError(f"RunLogger {name}={value!r} is invalid: expected an integer >= {least}")
        unknown = [name for name in sinks if name not in SINKS]
        if unknown:
            raise ValueError(f"RunLogger sinks={list(sinks)!r}: unknown {unknown}; valid: {', '.join(SINKS)}")
        self._active = is_main_process
        self._start_step = start_step
        self._last_step: int | None = None
        self._closed = False
        self._sinks: list = []
        self._remote = None
        if not self._active:
            return
        run_name = experiment_name or run_path(output_dir).name
        if is_remote(output_dir):  # a cloud URI: the sinks write into a local folder, copied up after each step
            self._remote, self._uploaded = run_path(output_dir), {}
            self._staging = output_dir = Path(tempfile.mkdtemp(prefix="jppo-runlog-"))
            self._download()
        output_dir = Path(output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        makers = {
            "console": lambda: ConsoleSink(total_steps, start_step, summary_every, stream, progress_bar),
            "jsonl": lambda: JsonlSink(output_dir, start_step),
            "tensorboard": lambda: TensorBoardSink(output_dir, start_step),
            "wandb": lambda: WandbSink(output_dir, project_name, run_name, config),
        }
        self._sinks = [makers[name]() for name in dict.fromkeys(sinks)]

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Records the metrics of training step ``step`` (scalars: floats, ints, numpy or jax scalars)."""
        if not self._active:
            return
        if self._closed:
            raise RuntimeError("RunLogger.log called after close()")
        step = self._checked_step(step)
        if "step" in metrics:
            raise ValueError(f"metric name 'step' at step {step} is reserved for the step number")
        values = {name: _scalar(name, value) for name, value in metrics.items()}
        for sink in self._sinks:
            sink.log(step, values)
        self._upload()
        self._last_step = step

    def log_generations(self, step: int, records: Sequence[Mapping[str, Any]]) -> None:
        """Records sampled responses of step ``step`` (dicts of JSON values: prompt, response, reward, ...); call
        it before :meth:`log` of the same step."""
        if self._active and records:
            for sink in self._sinks:
                sink.log_generations(step, [dict(record) for record in records])

    def close(self) -> None:
        """Flushes and closes every sink (and, with a cloud ``output_dir``, uploads and removes the staging
        folder); closing twice is harmless."""
        if not self._closed:
            for sink in self._sinks:
                sink.close()
            self._upload()
            if self._remote is not None:
                shutil.rmtree(self._staging, ignore_errors=True)
        self._closed = True

    def _download(self) -> None:
        """With a cloud ``output_dir``: the :data:`RESUMED_FILES` it holds, copied into the staging folder."""
        for name in RESUMED_FILES:
            if (self._remote / name).exists():
                (self._staging / name).write_bytes((self._remote / name).read_bytes())

    def _upload(self) -> None:
        """With a cloud ``output_dir``: each staged file changed since the last upload (size or modification
        time) written over the object of the same relative name."""
        if self._remote is None:
            return
        for local in sorted(self._staging.rglob("*")):
            relative = local.relative_to(self._staging)
            if not local.is_file() or relative.parts[0] == WANDB_FILES_DIR:
                continue
            stamp = (local.stat().st_size, local.stat().st_mtime_ns)
            if self._uploaded.get(relative) != stamp:
                target = self._remote / relative.as_posix()
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(local.read_bytes())
                self._uploaded[relative] = stamp

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


class JsonlSink:
    """``metrics.jsonl``: one strict-JSON object per step, non-finite values as ``null``, flushed per line; lines of
    an interrupted run from ``start_step`` on are dropped when it opens. Sampled responses of a step go to
    ``generations/step_N.jsonl``, one object per response."""

    def __init__(self, output_dir: Path, start_step: int):
        self._output_dir = output_dir
        path = output_dir / METRICS_FILE
        _drop_steps_from(path, start_step)
        self._file = path.open("a", encoding="utf-8")

    def log(self, step: int, values: dict[str, float]) -> None:
        record = {"step": step, **{name: value if math.isfinite(value) else None for name, value in values.items()}}
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def log_generations(self, step: int, records: list[dict]) -> None:
        directory = self._output_dir / GENERATIONS_DIR
        directory.mkdir(exist_ok=True)
        text = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
        (directory / f"step_{step}.jsonl").write_text(text, encoding="utf-8")

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    """Scalars in ``tensorboard/``; a resumed run tells TensorBoard to hide the earlier run's events from
    ``start_step`` on."""

    def __init__(self, output_dir: Path, start_step: int):
        # Imported here: tensorboardX imports torch and boto3 when they are installed (seconds of start-up).
        from tensorboardX import SummaryWriter

        # purge_step makes TensorBoard hide an earlier run's events from start_step on (all of them for a fresh
        # run). The suffix keeps two writers started in the same second from truncating each other's file (the
        # name has seconds).
        self._writer = SummaryWriter(
            str(output_dir / TENSORBOARD_DIR), purge_step=start_step, filename_suffix=f".{uuid.uuid4().hex[:8]}",
        )

    def log(self, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self._writer.add_scalar(name, value, step)
        self._writer.flush()

    def log_generations(self, step: int, records: list[dict]) -> None:
        pass  # TensorBoard gets scalars only

    def close(self) -> None:
        self._writer.close()


class ConsoleSink:
    """The terminal: on a terminal (``stream.isatty()``) with ``progress_bar``, a tqdm bar showing step/total,
    rate, ETA and the :data:`KEY_METRICS`; otherwise (CI logs) one compact line every ``summary_every`` steps, on
    the first step logged (and the first training step after step 0) and on the last."""

    def __init__(self, total_steps: int, start_step: int, summary_every: int, stream: TextIO | None,
                 progress_bar: bool):
        self._total_steps = total_steps
        self._start_step = start_step
        self._summary_every = summary_every
        self._stream = stream if stream is not None else sys.stderr
        self._started = time.monotonic()
        self._last_step: int | None = None
        self._bar = None
        if progress_bar and self._stream.isatty():
            self._bar = tqdm(
                total=total_steps, initial=max(start_step - 1, 0), file=self._stream, desc="train", unit="step",
                dynamic_ncols=True,
            )

    def log(self, step: int, values: dict[str, float]) -> None:
        first = self._last_step in (None, 0)  # the first training step gets its line after step 0's too
        self._last_step = step
        key_values = "  ".join(f"{short} {values[name]:.4g}" for name, short in KEY_METRICS.items() if name in values)
        if self._bar is not None:
            self._bar.set_postfix_str(key_values, refresh=False)
            self._bar.update(step - self._bar.n)
        elif first or step % self._summary_every == 0 or step == self._total_steps:
            print(self._summary_line(step, key_values), file=self._stream, flush=True)

    def log_generations(self, step: int, records: list[dict]) -> None:
        pass  # the files and wandb hold them

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def _summary_line(self, step: int, key_values: str) -> str:
        if step == 0:  # no training step yet: no rate, no ETA
            return " | ".join([f"step 0/{self._total_steps}", "before training"] + ([key_values] if key_values else []))
        steps_done = step - max(self._start_step - 1, 0)
        seconds_per_step = (time.monotonic() - self._started) / max(steps_done, 1)
        eta = _duration(seconds_per_step * max(self._total_steps - step, 0))
        parts = [f"step {step}/{self._total_steps}", f"{seconds_per_step:.3g} s/step", f"eta {eta}"]
        return " | ".join(parts + ([key_values] if key_values else []))


def import_wandb():
    """The ``wandb`` module, or an ImportError saying how to install it (the optional ``wandb`` extra)."""
    try:
        import wandb  # noqa: PLC0415 (optional, and slow to import)
    except ImportError:
        raise ImportError("the wandb package is not installed: pip install -e '.[wandb]'") from None
    return wandb


class WandbSink:
    """A Weights & Biases run (online, or offline with ``WANDB_MODE=offline``; files under ``WANDB_DIR``, default
    the output directory). Its id is kept in ``output_dir/wandb_run_id``, so a resumed run continues the same wandb
    run. Sampled responses become a table ``val/generations`` at their step."""

    def __init__(self, output_dir: Path, project: str, name: str, config: Mapping[str, Any] | None):
        self._wandb = import_wandb()
        id_file = output_dir / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id)
        self._run = self._wandb.init(
            project=project, name=name, id=run_id, resume="allow", config=dict(config or {}),
            dir=None if os.environ.get("WANDB_DIR") else str(output_dir),
        )

    def log(self, step: int, values: dict[str, float]) -> None:
        self._run.log(values, step=step)

    def log_generations(self, step: int, records: list[dict]) -> None:
        columns = list(records[0])
        table = self._wandb.Table(columns=columns, data=[[record.get(c) for c in columns] for record in records])
        self._run.log({"val/generations": table}, step=step)

    def close(self) -> None:
        self._run.finish()


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
