"""Rollout: sampling responses from a policy with a KV cache, compiled once per prompt-shape bucket."""

from jppo.rollout.sampler import Sampler
from jppo.rollout.processors import sample_tokens, tempered_log_prob
from jppo.rollout.decode import (
    RolloutBatch,
    SamplingParams,
    bucket_length,
    generate,
    make_generate_fn,
    pad_prompts,
    rollout,
)

__all__ = [
    "RolloutBatch",
    "Sampler",
    "SamplingParams",
    "bucket_length",
    "generate",
    "make_generate_fn",
    "pad_prompts",
    "rollout",
    "sample_tokens",
    "tempered_log_prob",
]
