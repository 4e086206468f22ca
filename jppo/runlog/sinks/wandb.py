"""Weights & Biases: a run of ``project_name`` / ``experiment_name``, with a table of the sampled responses (the
optional ``wandb`` package)."""

from __future__ import annotations

import os
import uuid

from jppo.runlog.sinks import SINKS, SinkRun

WANDB_ID_FILE = "wandb_run_id"  # the wandb run a resumed run continues
WANDB_FILES_DIR = "wandb"  # wandb's local files (when WANDB_DIR is unset), synced by wandb, not copied


def import_wandb():
    """The ``wandb`` module, or an ImportError saying how to install it (the optional ``wandb`` extra)."""
    try:
        import wandb  # noqa: PLC0415 (optional, and slow to import)
    except ImportError:
        raise ImportError("the wandb package is not installed: pip install -e '.[wandb]'") from None
    return wandb


@SINKS.register("wandb")
class WandbSink:
    """A Weights & Biases run (online, or offline with ``WANDB_MODE=offline``; files under ``WANDB_DIR``, default
    the output directory). Its id is kept in ``output_dir/wandb_run_id``, so a resumed run continues the same wandb
    run. Sampled responses become a table ``val/generations`` at their step."""

    def __init__(self, run: SinkRun):
        self._wandb = import_wandb()
        id_file = run.output_dir / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id)
        self._run = self._wandb.init(
            project=run.project_name, name=run.run_name, id=run_id, resume="allow", config=dict(run.config or {}),
            dir=None if os.environ.get("WANDB_DIR") else str(run.output_dir),
        )

    def log(self, step: int, values: dict[str, float]) -> None:
        self._run.log(values, step=step)

    def log_generations(self, step: int, records: list[dict]) -> None:
        columns = list(records[0])
        table = self._wandb.Table(columns=columns, data=[[record.get(c) for c in columns] for record in records])
        self._run.log({"val/generations": table}, step=step)

    def close(self) -> None:
        self._run.finish()
