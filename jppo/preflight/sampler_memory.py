"""The sampler's share of the memory plan: the widest prompt batch it prefills, the rows one device samples at once,
its KV caches, a decoding step's logits, the prefill's working set and its own copy of the policy's weights (the
rollout lines of :mod:`jppo.preflight.memory`'s table)."""

from __future__ import annotations

import math

from jppo.config import TrainConfig
from jppo.models.config import ModelConfig
from jppo.parallel.mesh import decoding_shards
from jppo.preflight.footprint import (
    Term,
    abstract_params,
    dtype_bytes,
    forward_layer_bytes_per_token,
    kv_cache_bytes,
    sampler_logits_bytes,
    shards,
    table_bytes,
)
from jppo.rollout.decode import decode_rows
from jppo.rollout.multiturn import longest_context
from jppo.rollout.sampler import bucket_length


def prompt_width(cfg: TrainConfig) -> int:
    return bucket_length(cfg.data.max_prompt_length, cfg.rollout.prompt_bucket)


def sampler_prompt_width(cfg: TrainConfig) -> int:
    """``P``: the widest prompt batch the sampler prefills; with ``rollout.env``, a turn's context (prompt and
    response so far)."""
    if cfg.rollout.env is None:
        return prompt_width(cfg)
    longest = longest_context(cfg.data.max_prompt_length, cfg.rollout.max_response_length)
    return bucket_length(longest, cfg.rollout.prompt_bucket)


def rollout_rows(cfg: TrainConfig, mesh: dict[str, int]) -> list[tuple[int, int]]:
    """``(prompts, rows)`` one device samples at once, for the training batch and (when the run validates) the
    validation batch (:func:`~jppo.config.views.sampled_batches`). The sampler fills a batch up to a multiple of
    its shards (every batch axis)."""
    from jppo.config.views import sampled_batches  # noqa: PLC0415 (views imports the models; keep `--help` light)

    batch_shards = decoding_shards(mesh)  # the sampler splits its prompts over every batch axis, sequence included
    return [(-(-prompts // batch_shards), -(-prompts // batch_shards) * n) for prompts, n in sampled_batches(cfg)]


def device_slots(rows: int, max_num_seqs: int, shards: int) -> int:
    """The rows one device decodes at once, of its ``rows``: all of them, or under continuous batching
    (``rollout.max_num_seqs`` below the ``rows x shards`` of the batch) its share of the slots, which the sampler
    splits over its decoding shards (:func:`jppo.config.devices.check_slots` makes them divide)."""
    decoded = decode_rows(rows * shards, max_num_seqs)
    return -(-decoded // shards)


def sampler_terms(cfg: TrainConfig, policy: ModelConfig, mesh: dict[str, int],
                  platform: str = "gpu") -> list[tuple[Term, ...]]:
    """The sampler's caches, a decoding step's logits, the prefill's working set and the table's second layout
    (the KV cache, sampler logits, prefill and table layout lines of the module docstring) of the training batch
    and (when the run validates) the validation batch, in that order."""
    from jppo.config.views import sampling_config  # noqa: PLC0415 (views imports the models; keep `--help` light)

    sampler, width, new = sampling_config(cfg, policy), sampler_prompt_width(cfg), cfg.rollout.max_response_length
    terms, tied_on_tpu = [], platform == "tpu" and sampler.tie_word_embeddings
    # the draws in one pass over the vocabulary (no filter, not greedy), which XLA:TPU fuses into the LM head
    one_pass = (cfg.rollout.top_k <= 0 and cfg.rollout.top_p >= 1.0, cfg.rollout.val_temperature > 0)
    for phase, (prompts, rows) in enumerate(rollout_rows(cfg, mesh)):
        decoded = device_slots(rows, cfg.rollout.max_num_seqs, decoding_shards(mesh))
        fused = platform == "tpu" and one_pass[phase]
        logits = sampler_logits_bytes(sampler, decoded, mesh, prompts if fused else None)
        terms.append((Term("kv_cache", kv_cache_bytes(sampler, prompts, width, decoded, new, mesh),
                           f"B={prompts} x P={width} + S={decoded} x T={new} x ..., c_s={dtype_bytes(sampler.dtype)}"),
                      Term("sampler_logits", logits, f"4 (a TPU's fused draw: 1) S={decoded} V' a"),
                      Term("prefill", prompts * width * forward_layer_bytes_per_token(sampler, width, mesh, platform,
                                                                                        prompts * width),
                           f"B={prompts} x P={width} x y"),
                      *([Term("table_layout", table_bytes(sampler, mesh), "V' D c_s")]
                        if tied_on_tpu and phase else [])))  # phase 1: the validation batch
    return terms


def rollout_weights_term(cfg: TrainConfig, policy: ModelConfig, mesh: dict[str, int]) -> Term:
    """The sampler's copy of the policy's weights (the rollout weights line of the module docstring)."""
    from flax import nnx  # noqa: PLC0415

    from jppo.config.views import sampling_config  # noqa: PLC0415
    from jppo.models.kv_cache import NORM_SCALES  # noqa: PLC0415
    from jppo.models.sharding import logical_names  # noqa: PLC0415

    decoding, sampler, total = {**mesh, "data": 1, "fsdp": 1}, sampling_config(cfg, policy), 0
    for path, variable in nnx.to_flat_state(abstract_params(policy)):
        shape, names = variable.shape, logical_names(variable)
        cast = path[-1] not in NORM_SCALES and sampler.dtype != policy.param_dtype
        if cast or shards(shape, names, mesh) != shards(shape, names, decoding):
            size = sampler.dtype if cast else policy.param_dtype
            total += math.prod(shape) // shards(shape, names, decoding) * dtype_bytes(size)
    return Term("rollout_weights", total, f"weights / tensor shards x c_s={dtype_bytes(sampler.dtype)}")
