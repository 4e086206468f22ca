"""``metrics.jsonl`` and ``generations/step_N.jsonl``: the run's metrics and sampled responses as JSON lines."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from jppo.core.paths import run_path
from jppo.runlog.sinks import SINKS, SinkRun

METRICS_FILE = "metrics.jsonl"
GENERATIONS_DIR = "generations"


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


@SINKS.register("jsonl")
class JsonlSink:
    """``metrics.jsonl``: one strict-JSON object per step, non-finite values as ``null``, flushed per line; lines of
    an interrupted run from ``start_step`` on are dropped when it opens. Sampled responses of a step go to
    ``generations/step_N.jsonl``, one object per response."""

    def __init__(self, run: SinkRun):
        self._output_dir = run.output_dir
        path = run.output_dir / METRICS_FILE
        _drop_steps_from(path, run.start_step)
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
