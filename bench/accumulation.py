"""Cost of micro-batching: actor update time and compile time for K = 1, 2, 4, 8 micro-batches of the SAME
mini-batch, and the global-normalization step against the legacy per-micro-batch step.

    python -m bench.accumulation [--quick] [--repeats N]

Everything is measured side by side in one process on the same model, batch and device: the ratios are what
matters (these machines are noisy). One "step" is one optimizer step (one mini-batch) through the engine's
jitted update (scan over K micro-batches feeding ``optax.MultiSteps``); its time is the median over interleaved
repeats after a warm-up call, and compile time is the warm-up call minus the median. Goals: K = 8 within 1.10x of
K = 1 per token, compile time flat in K, the global step within 2% of the legacy one.
"""

from __future__ import annotations

import dataclasses

from bench.actor_update import ActorUpdate, BatchShape, model_summary, synthetic_batch
from bench.report import command
from bench.timing import time_side_by_side
from jppo.core.settings import OptimConfig
from jppo.engine import ActorConfig
from jppo.models import ModelConfig

SIZES = {
    "full": dict(hidden=128, layers=4, heads=4, vocab=4096, batch=BatchShape(64, 32, 96), ks=(1, 2, 4, 8)),
    "quick": dict(hidden=64, layers=2, heads=4, vocab=512, batch=BatchShape(16, 8, 24), ks=(1, 8)),
}
LEGACY_K = 8


def measure(quick: bool, repeats: int) -> dict:
    """Step and compile time per K, the legacy step at K = 8, and the two headline ratios."""
    size = SIZES["quick" if quick else "full"]
    shape: BatchShape = size["batch"]
    model_cfg = ModelConfig(
        vocab_size=size["vocab"], hidden_size=size["hidden"], intermediate_size=4 * size["hidden"],
        num_layers=size["layers"], num_heads=size["heads"], model_type="qwen2",
    )
    batch = synthetic_batch(shape, size["vocab"], ragged=True)
    tokens = int(batch.response_mask.sum())
    base = ActorConfig(ppo_mini_batch_size=shape.rows, optim=OptimConfig(lr=1e-5))

    def update(k: int, normalization: str = "global") -> ActorUpdate:
        cfg = dataclasses.replace(base, ppo_micro_batch_size=shape.rows // k, normalization=normalization)
        return ActorUpdate(model_cfg, cfg, batch)

    candidates = {f"K={k}": update(k) for k in size["ks"]}
    candidates[f"K={LEGACY_K} legacy"] = update(LEGACY_K, "per_micro_batch")
    timings = time_side_by_side(candidates, repeats)
    one, eight = timings["K=1"], timings[f"K={LEGACY_K}"]
    return {
        "model": model_summary(model_cfg),
        "batch": dataclasses.asdict(shape),
        "response_tokens": tokens,
        "steps": {
            name: timing.to_dict() | {"us_per_token": 1e6 * timing.median_s / tokens}
            for name, timing in timings.items()
        },
        "accumulation_overhead_k8": eight.median_s / one.median_s,
        "compile_ratio_k8": eight.compile_s / max(one.compile_s, 1e-9),
        "normalization_overhead": eight.median_s / timings[f"K={LEGACY_K} legacy"].median_s,
    }


if __name__ == "__main__":
    command("accumulation", __doc__, measure)
