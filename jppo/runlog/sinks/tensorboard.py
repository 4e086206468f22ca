"""TensorBoard: the run's scalars in ``tensorboard/``."""

from __future__ import annotations

import uuid

from jppo.runlog.sinks import SINKS, SinkRun

TENSORBOARD_DIR = "tensorboard"


@SINKS.register("tensorboard")
class TensorBoardSink:
    """Scalars in ``tensorboard/``; a resumed run tells TensorBoard to hide the earlier run's events from
    ``start_step`` on."""

    def __init__(self, run: SinkRun):
        # tensorboardX imports torch and boto3 when they are installed (seconds of start-up): only for this sink
        from tensorboardX import SummaryWriter  # noqa: PLC0415

        # purge_step makes TensorBoard hide an earlier run's events from start_step on (all of them for a fresh
        # run). The suffix keeps two writers started in the same second from truncating each other's file (the
        # name has seconds).
        self._writer = SummaryWriter(
            str(run.output_dir / TENSORBOARD_DIR), purge_step=run.start_step,
            filename_suffix=f".{uuid.uuid4().hex[:8]}",
        )

    def log(self, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self._writer.add_scalar(name, value, step)
        self._writer.flush()

    def log_generations(self, step: int, records: list[dict]) -> None:
        pass  # TensorBoard gets scalars only

    def close(self) -> None:
        self._writer.close()
