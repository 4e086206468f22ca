"""Rewards for the trainer: rule-based answer checks, task scorers, user plug-ins, and the batch reward function."""

from jppo.core.errors import RewardFunctionError
from jppo.core.inputs import FUNCTION_STYLES, OverlongBufferConfig, RewardConfig
from jppo.rewards.code import program_score  # reward.kind: code (registers the kind)
from jppo.rewards.overlong import overlong_penalty
from jppo.rewards.plugin import RewardPlugin, load_reward_plugin
from jppo.rewards.reward_fn import REWARD_KINDS, CreditFn, RewardFn, build_credit_fn, build_reward_fn
from jppo.rewards.rules import boxed_score, extract_boxed, extract_gsm8k_answer, gsm8k_score, math_equal
from jppo.rewards.verify import math_verify_score

__all__ = [
    "REWARD_KINDS",
    "CreditFn",
    "FUNCTION_STYLES",
    "OverlongBufferConfig",
    "RewardConfig",
    "RewardFn",
    "RewardFunctionError",
    "RewardPlugin",
    "boxed_score",
    "build_credit_fn",
    "build_reward_fn",
    "extract_boxed",
    "extract_gsm8k_answer",
    "gsm8k_score",
    "load_reward_plugin",
    "math_equal",
    "math_verify_score",
    "overlong_penalty",
    "program_score",
]
