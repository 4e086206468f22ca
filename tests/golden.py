"""Golden vectors computed with verl's own functions (see ``shared/golden/verl/golden_verl.md``).

The file lives next to the repository, in the shared folder: ``<repo>/../shared/golden/verl``. A missing file is a
test failure (never a skip): parity with verl is part of what the suite promises.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

GOLDEN_DIR = Path(__file__).parents[2] / "shared" / "golden" / "verl"


@functools.cache
def load_golden() -> dict[str, np.ndarray]:
    """Every array of ``golden_verl.npz`` by key (read once per test session)."""
    path = GOLDEN_DIR / "golden_verl.npz"
    if not path.is_file():
        raise FileNotFoundError(
            f"golden vectors not found at {path}: the verl parity tests need shared/golden/verl/golden_verl.npz "
            "next to the repository checkout"
        )
    with np.load(path) as archive:
        return {key: archive[key] for key in archive.files}
