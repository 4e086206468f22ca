"""A change that quietly stops a quickstart learning fails here, not in a user's run: each quickstart trains its
first steps (seed 0, the suite's 8 devices) and every number stays in the corridor ``tests/corridors.json`` keeps,
set by ``python -m bench.numbers.corridors`` from the same runs over seeds 0-2 with a margin their spread
justifies (the training reward over the last steps at least so high, the SFT run's NLL so low, the gradient norm
and the sampler-trainer KL within their bands)."""

from __future__ import annotations

import json
import math

import pytest

from bench.numbers.corridors import CORRIDORS, measure

TABLE = json.loads(CORRIDORS.read_text())


@pytest.mark.parametrize("name", sorted(TABLE))
def test_each_quickstart_learns_within_its_corridor(name, tmp_path):
    entry = TABLE[name]
    values = measure(name, 0, tmp_path)
    assert set(values) == set(entry["corridor"])
    for key, (low, high) in entry["corridor"].items():
        low, high = -math.inf if low is None else low, math.inf if high is None else high
        seeds = {seed: measured[key] for seed, measured in entry["measured"].items()}
        assert low <= values[key] <= high, (
            f"{name} ({entry['config']}, {entry['steps']} steps): {key}={values[key]:.4f} left its corridor "
            f"[{low}, {high}] (seeds measured: {seeds})"
        )
