"""The sinks a run logs to, by name (``trainer.logger``): each registers itself in :data:`SINKS` in its own file.

A sink is a class decorated with ``@SINKS.register(name)``, built from the run's :class:`SinkRun` and having
``log(step, values)`` (finite or not, checked floats), ``log_generations(step, records)`` (sampled responses, before
the step's ``log``) and ``close()``. :class:`jppo.runlog.RunLogger` builds the ones a run selects.

Every module of this package is imported with it, in name order, so a new sink is one new file here.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, TextIO

from jppo.core.registry import Registry


@dataclasses.dataclass(frozen=True)
class SinkRun:
    """What a sink may need of the run it logs: where it writes and how its steps are numbered.

    Attributes:
        output_dir: the local folder the sinks write in (a staging folder for a cloud ``output_dir``).
        total_steps: the run's last training step.
        start_step: the first step this run logs (an interrupted run's lines from it on are dropped).
        summary_every: off a terminal, the console's summary line every this many steps.
        stream: the console's stream (``None``: standard error).
        progress_bar: the console's progress bar on a terminal.
        project_name, run_name: the wandb project and run.
        config: what the wandb run records as its configuration.
    """

    output_dir: Path
    total_steps: int
    start_step: int
    summary_every: int
    stream: TextIO | None
    progress_bar: bool
    project_name: str
    run_name: str
    config: Mapping[str, Any] | None


class Sink(Protocol):
    def log(self, step: int, values: dict[str, float]) -> None: ...

    def log_generations(self, step: int, records: list[dict]) -> None: ...

    def close(self) -> None: ...


SinkFactory = Callable[[SinkRun], Sink]
SINKS: Registry[SinkFactory] = Registry("sink")

# Last, once SINKS exists: each module registers its sink as it is imported.
for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
