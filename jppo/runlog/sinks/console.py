"""The terminal: a progress bar, or off a terminal one summary line every few steps."""

from __future__ import annotations

import sys
import time

from tqdm import tqdm

from jppo.runlog.sinks import SINKS, SinkRun

# Shown next to the progress bar and in summary lines, under these short names, when a step reports them.
KEY_METRICS: dict[str, str] = {
    "reward/mean": "reward",
    "actor/pg_loss": "pg_loss",
    "critic/vf_loss": "vf_loss",
    "actor/ppo_kl": "ppo_kl",
}


@SINKS.register("console")
class ConsoleSink:
    """The terminal: on a terminal (``stream.isatty()``) with ``progress_bar``, a tqdm bar showing step/total,
    rate, ETA and the :data:`KEY_METRICS`; otherwise (CI logs) one compact line every ``summary_every`` steps, on
    the first step logged (and the first training step after step 0) and on the last."""

    def __init__(self, run: SinkRun):
        self._total_steps = run.total_steps
        self._start_step = run.start_step
        self._summary_every = run.summary_every
        self._stream = run.stream if run.stream is not None else sys.stderr
        self._started = time.monotonic()
        self._last_step: int | None = None
        self._bar = None
        if run.progress_bar and self._stream.isatty():
            self._bar = tqdm(
                total=run.total_steps, initial=max(run.start_step - 1, 0), file=self._stream, desc="train",
                unit="step", dynamic_ncols=True,
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


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"
