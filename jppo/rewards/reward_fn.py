"""The reward of a batch of responses: correctness from a rule, the task or a plug-in, plus an optional format term.

``reward_i = score_i + format_weight * format_i`` where

- ``score_i`` in [0, 1] (any finite float for a plug-in) comes from ``reward.function`` when set, else from
  ``reward.kind``: ``task`` (the task's own scorer), ``gsm8k`` or ``boxed`` (see :mod:`jppo.rewards.rules`), or
  ``math_verify`` (boxed answers compared by the optional package math-verify, :mod:`jppo.rewards.verify`);
- ``format_i`` is 1 when the response ended with EOS and has the shape of ``reward.kind``'s answers: digits only
  for ``reverse_digits``/``add_small``, ``<answer>...</answer>`` for reasoning-gym, ``#### <number>`` for
  ``gsm8k``, a closed ``\\boxed{}`` for ``boxed`` and ``math_verify``; else 0.

Each kind registers itself in :data:`REWARD_KINDS` with ``@REWARD_KINDS.register(name)`` above a class whose
``scorer(cfg, task)`` and ``answer_format(cfg, task)`` build the two functions (:class:`RewardKind`).

Unlike verl's GSM8K scorer, which gives a fixed ``format_score`` *instead of* 0 to a well-formed wrong answer, the
format term here is added on top of correctness and is off by default.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol, Sequence

import numpy as np

import jppo.rewards.rules as rules  # the module, not the package: its __init__ imports this one
from jppo.core.checks import register_config_check
from jppo.core.errors import ConfigError, RewardFunctionError, one_line
from jppo.core.inputs import RewardConfig
from jppo.core.registry import Registry
from jppo.data.tasks import BUILTIN_TASKS, Example, Task
from jppo.rewards.plugin import load_reward_plugin
from jppo.rewards.verify import math_verify_score, require_math_verify

REWARD_KINDS: Registry[type[RewardKind]] = Registry(
    "reward kind", lambda name, names: f"reward.kind={name!r} is invalid: valid kinds are {list(names)}"
)



@register_config_check("reward.kind")
def check_reward_kind(cfg) -> None:
    """``reward.kind`` is a registered kind, and the optional package it needs is installed (math_verify)."""
    try:
        REWARD_KINDS.lookup(cfg.reward.kind)
        if cfg.reward.kind == "math_verify":
            require_math_verify()
    except ValueError as error:
        raise ConfigError(one_line(error)) from None


RewardFn = Callable[[list[str], list[Example], Sequence[bool]], np.ndarray]
Scorer = Callable[[str, Example, bool], float]


def build_reward_fn(cfg: RewardConfig, task: Optional[Task]) -> RewardFn:
    """``RewardFn(responses, examples, finished) -> float32 [B]``; ``task`` is ``None`` for file datasets.

    Everything that can be checked without responses is checked here: the plug-in is loaded, and ``kind: task``
    without a task is an error wherever the task would be needed (no plug-in, or a format term).
    """
    if cfg.kind == "task" and task is None and (cfg.function is None or cfg.format_weight != 0):
        raise ValueError(
            "reward.kind='task' needs a built-in or reasoning-gym data.task; with data.task='files' set reward.kind "
            f"to one of {[k for k in REWARD_KINDS if k != 'task']} or give reward.function"
        )
    plugin = load_reward_plugin(cfg.function, cfg.function_style) if cfg.function is not None else None
    kind = REWARD_KINDS.lookup(cfg.kind)
    score = None if plugin is not None else kind.scorer(cfg, task)
    follows_format = kind.answer_format(cfg, task) if cfg.format_weight != 0 else None

    def reward_fn(responses: list[str], examples: list[Example], finished: Sequence[bool]) -> np.ndarray:
        if not len(responses) == len(examples) == len(finished):
            raise ValueError(
                f"reward of {len(responses)} responses, {len(examples)} examples and {len(finished)} finished flags: "
                "the three must have one entry per response"
            )
        if plugin is not None:
            scores = plugin(responses, examples, finished)
        else:
            scores = _scores(score, cfg, responses, examples, finished)
        if follows_format is None:
            return scores
        formats = np.array([bool(done) and follows_format(text) for text, done in zip(responses, finished)], np.float32)
        return (scores + np.float32(cfg.format_weight) * formats).astype(np.float32)

    return reward_fn


CreditFn = Callable[[list[str], list[Example], Sequence[bool]], list[list[float]]]


def build_credit_fn(cfg: RewardConfig, task: Optional[Task]) -> Optional[CreditFn]:
    """With ``reward.token_level``: ``fn(responses, examples, finished) -> credits``, one per character of each
    response plus one for its EOS when finished, summing to the task's score; ``None`` otherwise."""
    if not cfg.token_level:
        return None
    if task is None or not hasattr(task, "credit") or cfg.function is not None or cfg.kind != "task":
        raise ValueError(
            "reward.token_level=true needs reward.kind='task', no reward.function, and a data.task with per-position "
            f"credit (built-in tasks: {', '.join(credit_tasks())})"
        )
    return lambda responses, examples, finished: [
        task.credit(text, example, bool(done)) for text, example, done in zip(responses, examples, finished)
    ]


def credit_tasks() -> list[str]:
    """The registered built-in tasks that pay credit per position (a ``credit`` method), sorted."""
    return sorted(name for name in BUILTIN_TASKS.names() if hasattr(BUILTIN_TASKS[name], "credit"))


class RewardKind(Protocol):
    """A ``reward.kind``: ``scorer`` builds ``score(text, example, finished)`` (built only without a plug-in),
    ``answer_format`` builds ``follows_format(text)`` (built only for a format term)."""

    @staticmethod
    def scorer(cfg: RewardConfig, task: Optional[Task]) -> Scorer: ...

    @staticmethod
    def answer_format(cfg: RewardConfig, task: Optional[Task]) -> Callable[[str], bool]: ...


@REWARD_KINDS.register("task")
class TaskKind:
    """The task's own scorer and answer shape."""

    @staticmethod
    def scorer(cfg: RewardConfig, task: Task) -> Scorer:
        return task.score

    @staticmethod
    def answer_format(cfg: RewardConfig, task: Task) -> Callable[[str], bool]:
        return task.follows_format


@REWARD_KINDS.register("gsm8k")
class Gsm8kKind:
    """The number after ``####`` (with ``gsm8k_flexible``, the last number) against the answer."""

    @staticmethod
    def scorer(cfg: RewardConfig, task: Optional[Task]) -> Scorer:
        return lambda text, example, finished: rules.gsm8k_score(text, example.answer, cfg.gsm8k_flexible)

    @staticmethod
    def answer_format(cfg: RewardConfig, task: Optional[Task]) -> Callable[[str], bool]:
        return lambda text: rules.extract_gsm8k_answer(text) is not None


@REWARD_KINDS.register("boxed")
class BoxedKind:
    """The last ``\\boxed{}`` against the answer, by :func:`jppo.rewards.rules.math_equal`."""

    @staticmethod
    def scorer(cfg: RewardConfig, task: Optional[Task]) -> Scorer:
        return lambda text, example, finished: rules.boxed_score(text, example.answer)

    @staticmethod
    def answer_format(cfg: RewardConfig, task: Optional[Task]) -> Callable[[str], bool]:
        return lambda text: rules.extract_boxed(text) is not None


@REWARD_KINDS.register("math_verify")
class MathVerifyKind(BoxedKind):
    """Boxed answers compared by the optional package math-verify."""

    @staticmethod
    def scorer(cfg: RewardConfig, task: Optional[Task]) -> Scorer:
        require_math_verify()
        return lambda text, example, finished: math_verify_score(text, example.answer)


@REWARD_KINDS.register("none")
class NoKind:
    """No rule score (a reward model's alone); it has no answer shape, so no format term."""

    @staticmethod
    def scorer(cfg: RewardConfig, task: Optional[Task]) -> Scorer:
        return lambda text, example, finished: 0.0

    @staticmethod
    def answer_format(cfg: RewardConfig, task: Optional[Task]) -> Callable[[str], bool]:
        with_format = ", ".join(kind for kind in REWARD_KINDS if kind != "none")
        raise ValueError(f"reward.format_weight needs a reward.kind with a format ({with_format}), not 'none'")


def _scores(
    score: Callable[[str, Example, bool], float],
    cfg: RewardConfig,
    responses: list[str],
    examples: list[Example],
    finished: Sequence[bool],
) -> np.ndarray:
    values = np.empty(len(responses), np.float32)
    for index, (text, example, done) in enumerate(zip(responses, examples, finished)):
        try:
            values[index] = score(text, example, bool(done))
        except Exception as error:
            where = example.meta.get("location", "a generated example")
            raise RewardFunctionError(
                f"reward.kind={cfg.kind} failed on sample {index} ({where}): {type(error).__name__}: {error}"
            ) from error
    return values
