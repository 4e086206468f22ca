"""DAPO's soft overlong punishment: a reward penalty that grows linearly over the last tokens of the length limit.

With the maximum response length ``L``, a buffer of ``B`` tokens and a factor ``f``, a response of ``l`` tokens gets

    penalty(l) = f * min(0, (L - B - l) / B)

added to its reward: nothing up to ``L - B`` tokens, then falling linearly to ``-f`` at ``L``. Responses that run
into the limit are pushed back gradually instead of being cut off with no signal.
"""

from __future__ import annotations

import numpy as np


def overlong_penalty(lengths: np.ndarray, max_length: int, buffer: int, factor: float) -> np.ndarray:
    """``factor * min(0, (max_length - buffer - lengths) / buffer)`` per response (float32 ``[N]``)."""
    lengths = np.asarray(lengths, np.float64)
    return (factor * np.minimum(0.0, (max_length - buffer - lengths) / buffer)).astype(np.float32)
