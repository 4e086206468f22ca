"""Rollout: sampling responses from a policy with a KV cache, compiled once per prompt-shape bucket."""

from jppo.rollout.sampler import Sampler, bucket_length, pad_prompts
from jppo.rollout.processors import sample_tokens, tempered_log_prob
from jppo.rollout.decode import RolloutBatch, SamplingParams, generate, make_generate_fn, rollout

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
