"""Accelerator mode: model FLOPs utilisation (MFU) of the actor update step, decode tokens/s against the
memory-bandwidth roofline, and the device's peak memory, for a ~0.5B-parameter Qwen2-shaped random model in bf16.

    python -m bench.accelerator [--stand-in] [--peak-tflops X] [--bandwidth-gbs Y]

``python -m bench.run`` runs this when ``jax.default_backend()`` is ``gpu`` or ``tpu``; alone it takes a few
minutes on one GPU (two compilations of the update and decode programs dominate). ``--stand-in`` runs the same
code on a tiny model, which is how CI exercises it on CPU (the code path, not the numbers).

Counting (model FLOPs, as in the PaLM paper's appendix B; recomputation such as jppo's checkpointed log-prob
chunks is not counted):

    FLOPs per trained token = 6 N + 12 L H E T

with N the parameters that take part in matrix products (every layer's q, k, v, o and MLP kernels, and the LM head
once; the input embedding is a lookup), L layers, H query heads of size E, T the sequence length. MFU = achieved
FLOP/s over the device's dense bf16 peak. Decoding one token per row reads every parameter once, so the
bandwidth roofline is ``batch * bandwidth / parameter bytes`` tokens/s (KV-cache reads come on top; with short
caches they are small). A decode step's time is ``(t(n new tokens) - t(1 new token)) / (n - 1)`` over the fastest
of the repeats of each (the least disturbed, which a difference needs), which takes the prefill out.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench.actor_update import ActorUpdate, BatchShape, model_summary, synthetic_batch
from bench.report import section
from bench.timing import time_side_by_side
from jppo.core.settings import OptimConfig
from jppo.engine import ActorConfig
from jppo.models import CausalLM, ModelConfig, create_model
from jppo.rollout import SamplingParams, make_generate_fn

# Qwen2.5-0.5B's shape (494M parameters), initialised at random
QWEN2_0_5B = dict(
    vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14, num_kv_heads=2,
    tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=32768, model_type="qwen2",
)
STAND_IN = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
    tie_word_embeddings=True, model_type="qwen2",
)

# (device_kind substring, dense bf16 FLOP/s, memory bandwidth bytes/s), vendor spec sheets; first match wins
DEVICE_PEAKS: tuple[tuple[str, float, float], ...] = (
    ("H200", 989e12, 4.8e12),
    ("H100 PCIe", 756e12, 2.0e12),
    ("H100", 989e12, 3.35e12),
    ("A100", 312e12, 2.039e12),
    ("L4", 121e12, 0.3e12),
    ("TPU v6 lite", 918e12, 1.64e12),
    ("TPU v5 lite", 197e12, 0.819e12),
    ("TPU v5", 459e12, 2.765e12),
    ("TPU v4", 275e12, 1.2e12),
)


@dataclasses.dataclass(frozen=True)
class AcceleratorSize:
    model: dict
    update_batch: BatchShape
    decode_batch: int
    decode_prompt: int
    decode_new_tokens: int
    repeats: int


FULL = AcceleratorSize(
    QWEN2_0_5B, BatchShape(8, 256, 768), decode_batch=64, decode_prompt=128, decode_new_tokens=256, repeats=5
)
STAND_IN_SIZE = AcceleratorSize(
    STAND_IN, BatchShape(2, 8, 24), decode_batch=2, decode_prompt=8, decode_new_tokens=64, repeats=3
)


def device_peaks(device_kind: str) -> tuple[float | None, float | None]:
    """(peak bf16 FLOP/s, memory bandwidth bytes/s) of a device kind, or (None, None) when unknown (CPUs)."""
    for name, flops, bandwidth in DEVICE_PEAKS:
        if name.lower() in device_kind.lower():
            return flops, bandwidth
    return None, None


def matmul_parameters(cfg: ModelConfig) -> int:
    """N: parameters used in matrix products per token (layer kernels and the LM head; not the embedding lookup)."""
    width, q, kv = cfg.hidden_size, cfg.q_size, cfg.kv_size
    per_layer = width * q + 2 * width * kv + q * width + 3 * width * cfg.intermediate_size
    return cfg.num_layers * per_layer + cfg.vocab_size * width


def training_flops_per_token(cfg: ModelConfig, length: int) -> float:
    """``6 N + 12 L H E T``: forward and backward model FLOPs of one token in a sequence of ``length``."""
    return 6.0 * matmul_parameters(cfg) + 12.0 * cfg.num_layers * cfg.q_size * length


def _peak_device_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats()  # None on CPU
    return None if not stats else int(stats.get("peak_bytes_in_use", 0)) or None


def update_mfu(size: AcceleratorSize, peak_flops: float | None) -> dict:
    """Time of the actor update step (bf16 compute, float32 master weights) and its MFU."""
    cfg = ModelConfig(**size.model, dtype="bfloat16", param_dtype="float32")
    shape = size.update_batch
    batch = synthetic_batch(shape, cfg.vocab_size, ragged=False)
    actor_cfg = ActorConfig(ppo_mini_batch_size=shape.rows, ppo_micro_batch_size=shape.rows, optim=OptimConfig(lr=1e-6))
    update = ActorUpdate(cfg, actor_cfg, batch)
    parameters = sum(x.size for x in jax.tree.leaves(update.state.params))
    timing = time_side_by_side({"update": update}, size.repeats)["update"]
    flops = training_flops_per_token(cfg, shape.length) * shape.tokens
    achieved = flops / timing.median_s
    return {
        "model": model_summary(cfg),
        "parameters": parameters,
        "matmul_parameters": matmul_parameters(cfg),
        "batch": {"rows": shape.rows, "length": shape.length, "tokens": shape.tokens},
        "step": timing.to_dict(),
        "tokens_per_s": shape.tokens / timing.median_s,
        "model_flops_per_step": flops,
        "achieved_flops_per_s": achieved,
        "peak_flops_per_s": peak_flops,
        "mfu": achieved / peak_flops if peak_flops else None,
        "device_peak_bytes_after_update": _peak_device_bytes(),
    }


def decode_roofline(size: AcceleratorSize, bandwidth: float | None) -> dict:
    """Greedy KV-cache decoding tokens/s (bf16 weights) against ``batch * bandwidth / parameter bytes``."""
    cfg = ModelConfig(**size.model, dtype="bfloat16", param_dtype="bfloat16")
    graphdef, state = nnx.split(create_model(CausalLM, cfg))
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(1, cfg.vocab_size, (size.decode_batch, size.decode_prompt)), jnp.int32)
    mask = jnp.ones(ids.shape, bool)
    key = jax.random.key(0)
    new = size.decode_new_tokens

    def generator(tokens: int):
        generate = make_generate_fn(graphdef, SamplingParams(max_new_tokens=tokens, greedy=True))
        return lambda: jax.block_until_ready(generate(state, ids, mask, key).response_ids)

    timings = time_side_by_side({"one": generator(1), "all": generator(new)}, size.repeats)
    decode_s = timings["all"].min_s - timings["one"].min_s
    if decode_s <= 0:
        raise RuntimeError(
            f"decoding {new - 1} tokens took no measurable time ({timings['all'].min_s:.6f} s with them, "
            f"{timings['one'].min_s:.6f} s without): use more decode_new_tokens"
        )
    step_s = decode_s / (new - 1)
    tokens_per_s = size.decode_batch / step_s
    roofline = size.decode_batch * bandwidth / param_bytes if bandwidth else None
    return {
        "batch": size.decode_batch,
        "prompt_length": size.decode_prompt,
        "new_tokens": new,
        "parameter_bytes": param_bytes,
        "generate_s": {name: timing.to_dict() for name, timing in timings.items()},
        "decode_step_s": step_s,
        "tokens_per_s": tokens_per_s,
        "bandwidth_bytes_per_s": bandwidth,
        "roofline_tokens_per_s": roofline,
        "fraction_of_roofline": tokens_per_s / roofline if roofline else None,
    }


def measure(size: AcceleratorSize = FULL, peak_flops: float | None = None, bandwidth: float | None = None) -> dict:
    """MFU of the update, decode against the roofline, device peak memory. Peaks default to the device's entry in
    :data:`DEVICE_PEAKS` (None on CPUs, and then so are MFU and the roofline)."""
    kind = jax.devices()[0].device_kind
    known_flops, known_bandwidth = device_peaks(kind)
    peak_flops = peak_flops or known_flops
    bandwidth = bandwidth or known_bandwidth
    return {
        "device_kind": kind,
        "update": update_mfu(size, peak_flops),
        "decode": decode_roofline(size, bandwidth),
        "device_peak_bytes": _peak_device_bytes(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stand-in", action="store_true", help="tiny model: the code path on any backend")
    parser.add_argument("--peak-tflops", type=float, help="dense bf16 peak of the device (default: from the table)")
    parser.add_argument("--bandwidth-gbs", type=float, help="memory bandwidth in GB/s (default: from the table)")
    args = parser.parse_args()
    result = measure(
        STAND_IN_SIZE if args.stand_in else FULL,
        args.peak_tflops * 1e12 if args.peak_tflops else None,
        args.bandwidth_gbs * 1e9 if args.bandwidth_gbs else None,
    )
    print(section("accelerator", result))


if __name__ == "__main__":
    main()
