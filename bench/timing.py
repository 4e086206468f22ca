"""Wall-clock timing for the benchmarks: a warm-up call, then repeats interleaved across the things compared.

The machines these run on are shared and noisy. Every benchmark is therefore a *ratio* of two (or more)
candidates measured in the same process, and :func:`time_side_by_side` times them in rounds (A, B, A, B, ...)
rather than all of A then all of B, so that a change in the machine's load during the run hits every candidate
alike. Each candidate is a callable that returns only once its work is done (it blocks on device results).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable, Mapping


@dataclasses.dataclass(frozen=True)
class Timing:
    """Seconds of one candidate: the warm-up (first) call, and median, min and max over the timed repeats."""

    first_s: float
    median_s: float
    min_s: float
    max_s: float
    repeats: int

    @property
    def compile_s(self) -> float:
        """What the first call cost beyond a warm call: compilation (and first-touch allocation)."""
        return max(self.first_s - self.median_s, 0.0)

    def to_dict(self) -> dict[str, float]:
        return {
            "median_s": self.median_s, "min_s": self.min_s, "max_s": self.max_s, "first_s": self.first_s,
            "compile_s": self.compile_s, "repeats": self.repeats,
        }


def _seconds(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def time_side_by_side(candidates: Mapping[str, Callable[[], object]], repeats: int) -> dict[str, Timing]:
    """Times each candidate once untimed-for-the-statistics (the warm-up, kept as ``first_s``), then ``repeats``
    rounds in which every candidate runs once, in the given order."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    first = {name: _seconds(run) for name, run in candidates.items()}
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, run in candidates.items():
            samples[name].append(_seconds(run))
    return {
        name: Timing(first[name], statistics.median(times), min(times), max(times), repeats)
        for name, times in samples.items()
    }
