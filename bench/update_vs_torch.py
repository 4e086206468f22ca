"""jppo's actor update step against an equivalent PyTorch eager implementation: tokens/s of forward, backward and
AdamW on the same model, weights and batch, side by side.

    python -m bench.update_vs_torch [--quick] [--repeats N]

Both sides: the same Qwen2-shaped model (RMSNorm, RoPE, GQA with q/k/v biases, SwiGLU, untied head), float32,
the same initial weights (copied from jppo into :class:`bench.torch_decoder.TorchCausalLM`), the same unpadded
batch, the same PPO loss, clipping and AdamW settings; torch runs with as many threads as XLA's CPU pool. jppo's
step is the trainer's (one micro-batch, K = 1). Tokens/s counts every token of every row. The ratio is
jppo tokens/s over torch tokens/s: above 1, jppo is faster.
"""

from __future__ import annotations

import jax
import torch

from bench.actor_update import ActorUpdate, BatchShape, model_summary, synthetic_batch
from bench.environment import match_torch_threads
from bench.report import command
from bench.timing import time_side_by_side
from bench.torch_decoder import TorchActorUpdate, TorchCausalLM
from jppo.core.settings import OptimConfig
from jppo.engine import ActorConfig
from jppo.models import ModelConfig

SIZES = {
    "full": {
        "tiny": dict(layers=2, hidden=128, heads=4, kv_heads=2, vocab=4096, batch=BatchShape(16, 32, 96)),
        "small": dict(layers=4, hidden=512, heads=8, kv_heads=2, vocab=32768, batch=BatchShape(4, 64, 192)),
    },
    "quick": {
        "tiny": dict(layers=2, hidden=64, heads=4, kv_heads=2, vocab=512, batch=BatchShape(4, 8, 24)),
        "small": dict(layers=2, hidden=128, heads=4, kv_heads=2, vocab=1024, batch=BatchShape(2, 16, 48)),
    },
}


def model_config(size: dict) -> ModelConfig:
    return ModelConfig(
        vocab_size=size["vocab"], hidden_size=size["hidden"], intermediate_size=4 * size["hidden"],
        num_layers=size["layers"], num_heads=size["heads"], num_kv_heads=size["kv_heads"], model_type="qwen2",
        tie_word_embeddings=False,
    )


def measure(quick: bool, repeats: int) -> dict:
    """Both sizes, "tiny" and "small" (:func:`measure_size`)."""
    return {name: measure_size(name, quick, repeats) for name in ("tiny", "small")}


def measure_size(name: str, quick: bool, repeats: int) -> dict:
    """Tokens/s of both implementations at size ``name`` ("tiny" or "small") and their ratio."""
    size = SIZES["quick" if quick else "full"][name]
    shape: BatchShape = size["batch"]
    cfg = model_config(size)
    batch = synthetic_batch(shape, cfg.vocab_size, ragged=False)
    actor_cfg = ActorConfig(ppo_mini_batch_size=shape.rows, ppo_micro_batch_size=shape.rows, optim=OptimConfig(lr=1e-5))
    threads = match_torch_threads()
    device = "cuda" if torch.cuda.is_available() else "cpu"  # jppo runs on JAX's default device
    jppo_update = ActorUpdate(cfg, actor_cfg, batch)
    torch_update = TorchActorUpdate(TorchCausalLM.from_jppo(cfg, jppo_update.host_params()), batch, actor_cfg, device)
    # The first step of each (the warm-up call) starts from the same weights: its loss is a parity check of the two
    # implementations.
    first_loss: dict[str, float] = {}

    def jppo_step() -> None:
        first_loss.setdefault("jppo", jppo_update()["actor/pg_loss"])

    def torch_step() -> None:
        first_loss.setdefault("torch", torch_update()["pg_loss"])

    timings = time_side_by_side({"jppo": jppo_step, "torch": torch_step}, repeats)
    tokens_per_s = {side: shape.tokens / timing.median_s for side, timing in timings.items()}
    return {
        "model": model_summary(cfg),
        "batch": {"rows": shape.rows, "length": shape.length, "tokens": shape.tokens},
        "torch_threads": threads,
        "torch_device": device,
        "jax_device": jax.devices()[0].device_kind,
        "first_pg_loss": first_loss,
        "steps": {side: timing.to_dict() for side, timing in timings.items()},
        "tokens_per_s": tokens_per_s,
        "ratio": tokens_per_s["jppo"] / tokens_per_s["torch"],
    }


if __name__ == "__main__":
    command("update_vs_torch", __doc__, measure)
