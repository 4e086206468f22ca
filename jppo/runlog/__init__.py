"""Run logging through pluggable sinks: the terminal, ``metrics.jsonl``, TensorBoard and Weights & Biases.

:class:`RunLogger` checks each step's metrics once and hands them to the sinks the run selects
(``trainer.logger``, names in :data:`SINKS`): ``console`` (a progress bar, or off a terminal summary lines),
``jsonl`` (``metrics.jsonl``, and the sampled validation responses in ``generations/step_N.jsonl``), ``tensorboard``
(scalars in ``tensorboard/``) and ``wandb`` (a run of ``project_name`` / ``experiment_name``, with a table of the
sampled responses; the optional ``wandb`` package). Each sink is a class in its own module of
:mod:`jppo.runlog.sinks`, registered there by name; a new one is one more such module.

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

import operator
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence, TextIO

from jppo.core.checks import choice, register_config_check
from jppo.core.errors import ConfigError
from jppo.core.paths import is_remote, run_path
from jppo.runlog.sinks import SINKS, SinkRun  # every sink, registered
from jppo.runlog.sinks.jsonl import GENERATIONS_DIR, METRICS_FILE, read_metrics
from jppo.runlog.sinks.tensorboard import TENSORBOARD_DIR
from jppo.runlog.sinks.wandb import WANDB_FILES_DIR, WANDB_ID_FILE, import_wandb

RESUMED_FILES = (METRICS_FILE, WANDB_ID_FILE)  # what a sink reads back when a run resumes
DEFAULT_SINKS = ("console", "jsonl", "tensorboard")
# what a run's readers take from the package: the logger, the sinks' registry and the files a run writes
__all__ = ["DEFAULT_SINKS", "GENERATIONS_DIR", "METRICS_FILE", "SINKS", "TENSORBOARD_DIR", "RunLogger", "read_metrics"]


@register_config_check("trainer.logger")
def check_sinks(cfg) -> None:
    """``trainer.logger``: known sink names, each once; ``wandb`` only where its package imports (an optional
    extra)."""
    sinks = cfg.trainer.logger
    for name in sinks:
        choice("trainer.logger", name, SINKS)
    if len(set(sinks)) < len(sinks):
        raise ConfigError(f"trainer.logger={list(sinks)!r} names a sink twice")
    if "wandb" in sinks:
        try:
            import_wandb()
        except ImportError as error:
            raise ConfigError(f"trainer.logger={list(sinks)!r}: {error}") from None


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
        run = SinkRun(
            output_dir, total_steps, start_step, summary_every, stream, progress_bar, project_name, run_name, config
        )
        self._sinks = [SINKS[name](run) for name in dict.fromkeys(sinks)]

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


def _scalar(name: str, value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"metric {name!r} is not a scalar number: {value!r}") from None
