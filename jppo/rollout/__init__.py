"""Rollout: sampling responses from a policy with a KV cache, compiled once per prompt-shape bucket."""

from jppo.rollout import vllm_engine  # registers rollout.engine: vllm (vLLM itself is imported when it starts)
from jppo.rollout.decode import RolloutBatch, SamplingParams, generate, make_generate_fn, rollout
from jppo.rollout.processors import sample_tokens, tempered_log_prob
from jppo.rollout.sampler import ROLLOUT_ENGINES, JppoEngine, RolloutEngineSpec, Sampler, bucket_length, pad_prompts

__all__ = [
    "ROLLOUT_ENGINES",
    "RolloutEngineSpec",
    "JppoEngine",
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
    "vllm_engine",
]
