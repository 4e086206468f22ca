"""Wall time per phase of a training step, reported as ``timing/<phase>`` metrics."""

from __future__ import annotations

import contextlib
import time


class PhaseTimer:
    """Wall time per phase of a step (``timing/<phase>`` metrics). Every phase ends with its results on the host,
    so asynchronous dispatch does not move time from one phase into the next."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.started = time.perf_counter()

    @contextlib.contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        yield
        self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def report(self, tokens: float) -> dict[str, float]:
        """``timing/<phase>`` and ``timing/step`` seconds since the timer was made, and ``perf/tokens_per_s``."""
        total = time.perf_counter() - self.started
        phases = {f"timing/{phase}": seconds for phase, seconds in self.seconds.items()}
        return phases | {"timing/step": total, "perf/tokens_per_s": tokens / total}
