"""Golden vectors computed with verl's own functions, float64 (``tests/golden_verl/golden_verl.md`` describes
every key; ``tests/golden_verl/PARITY.md`` lists where jppo differs from verl on purpose).

The vectors ship with the repository, in ``tests/golden_verl/``, so the suite runs on a clone alone. A missing
file is a test failure (never a skip): parity with verl is part of what the suite promises.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

GOLDEN_DIR = Path(__file__).parent / "golden_verl"


@functools.cache
def load_golden() -> dict[str, np.ndarray]:
    """Every array of ``golden_verl.npz`` by key (read once per test session)."""
    path = GOLDEN_DIR / "golden_verl.npz"
    if not path.is_file():
        raise FileNotFoundError(
            f"golden vectors not found at {path}: the verl parity tests need tests/golden_verl/golden_verl.npz "
            "from the repository"
        )
    with np.load(path) as archive:
        return {key: archive[key] for key in archive.files}
