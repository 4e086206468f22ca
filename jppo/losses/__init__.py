"""Pure, jittable loss terms. Every term returns a per-token matrix that goes through :func:`agg_loss`."""

from jppo.losses.aggregate import (
    AGG_MODES,
    NormStats,
    agg_loss,
    check_mode,
    global_norm_stats,
    masked_sum,
    safe_divide,
)

__all__ = [
    "AGG_MODES",
    "NormStats",
    "agg_loss",
    "check_mode",
    "global_norm_stats",
    "masked_sum",
    "safe_divide",
]
