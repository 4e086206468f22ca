"""``reward.kind: code``: a response's program run against its row's tests, each test in a box of its own.

``score_i = passed_i / tests_i`` (``reward.code.score: fraction``) or ``1[passed_i = tests_i]`` (``all``), where
the program is the response's last fenced block (three backticks, an optional language, a newline, the code, three
backticks; none: 0; when the prompt opens the block, the response up to the fence that closes it) and a test passes
when its run in a box (:mod:`jppo.rewards.sandbox`, the limits of ``reward.code``) exits with status 0 and, for a
stdin / stdout test, prints the expected output (lines compared with trailing whitespace and trailing empty lines
dropped).

The row's answer (``data.answer_key``; the built-in task ``write_program`` makes them) holds its tests in the
layouts verl-style code datasets use:

- a JSON object ``{"inputs": [...], "outputs": [...]}``: standard input and the expected standard output, pair by
  pair (a call-based ``"fn_name"`` is refused in one line: it names a function to call, not a program to run);
- a JSON list of strings, or text of ``assert`` lines: each assert run after the program, alone.

A box that cannot be built here is a refusal at start-up (:func:`check_code_reward`), not a zero at run time.
"""

from __future__ import annotations

import json
from typing import Callable, Optional

from jppo.core.checks import register_config_check
from jppo.core.errors import ConfigError
from jppo.core.inputs import FILES_TASK, CodeRewardConfig, RewardConfig
from jppo.data.code_task import program_of
from jppo.data.tasks import Example, Task
from jppo.rewards.reward_fn import REWARD_KINDS, Scorer
from jppo.rewards.sandbox import Limits, check_box, run_program


def limits_of(cfg: CodeRewardConfig) -> Limits:
    return Limits(cpu_s=cfg.cpu_s, wall_s=cfg.wall_s, memory_mb=cfg.memory_mb, file_mb=cfg.file_mb,
                  processes=cfg.processes, output_kb=cfg.output_kb)


def row_tests(answer: str) -> list[tuple[str, str, Optional[str]]]:
    """The tests of a row's answer as ``(program suffix, stdin, expected stdout or None)``; ``ValueError`` (one
    line) for an answer in none of the layouts."""
    try:
        spec = json.loads(answer)
    except (json.JSONDecodeError, TypeError):
        spec = None
    if isinstance(spec, dict):
        if "fn_name" in spec:
            raise ValueError(f"the tests name a function to call (fn_name={spec['fn_name']!r}); reward.kind=code "
                             "runs programs against stdin / stdout pairs or assert statements")
        inputs, outputs = spec.get("inputs"), spec.get("outputs")
        if not (isinstance(inputs, list) and isinstance(outputs, list) and len(inputs) == len(outputs) > 0):
            raise ValueError("a JSON test object needs equally long, non-empty 'inputs' and 'outputs' lists")
        return [("", str(i), str(o)) for i, o in zip(inputs, outputs)]
    if isinstance(spec, list) and spec and all(isinstance(line, str) for line in spec):
        return [("\n\n" + line + "\n", "", None) for line in spec]
    lines = [line for line in str(answer).splitlines() if line.lstrip().startswith("assert")]
    if spec is None and lines:
        return [("\n\n" + line.strip() + "\n", "", None) for line in lines]
    raise ValueError(f"the row's answer {str(answer)[:60]!r} holds no tests: a JSON {{inputs, outputs}} object, a "
                     "JSON list of assert statements, or assert lines")


def same_output(printed: str, expected: str) -> bool:
    """Outputs equal line by line, trailing whitespace and trailing empty lines aside."""
    tidy = lambda text: [line.rstrip() for line in text.rstrip().splitlines()]  # noqa: E731
    return tidy(printed) == tidy(expected)


def program_score(text: str, example: Example, cfg: CodeRewardConfig) -> float:
    """The response's score against the row's tests (module docstring)."""
    tests = row_tests(example.answer)
    program = program_of(text, example.prompt)
    if program is None:
        return 0.0
    limits, passed = limits_of(cfg), 0
    for suffix, stdin, expected in tests:
        outcome = run_program(program + suffix, stdin, limits, network=cfg.network)
        if outcome.status == "unsupported":  # the box worked at start-up: a failure here is not the program's
            raise OSError(outcome.stderr)
        passed += outcome.ok and (expected is None or same_output(outcome.stdout, expected))
    if cfg.score == "all":
        return float(passed == len(tests))
    return passed / len(tests)


@REWARD_KINDS.register("code")
class CodeKind:
    """The response's last fenced block run against the row's tests, in a box."""

    @staticmethod
    def scorer(cfg: RewardConfig, task: Optional[Task]) -> Scorer:
        return lambda text, example, finished: program_score(text, example, cfg.code)

    @staticmethod
    def answer_format(cfg: RewardConfig, task: Optional[Task]) -> Callable[[str], bool]:
        return lambda text: program_of(text) is not None


@register_config_check("reward.code")
def check_code_reward(cfg) -> None:
    """With ``reward.kind: code``, a box can be built here (with ``reward.code.network: deny``, one without a
    network); ``data.task: write_program`` is scored by running its programs."""
    if cfg.data.task == "write_program" and cfg.reward.kind != "code" and cfg.reward.function is None:
        raise ConfigError(f"reward.kind={cfg.reward.kind!r} cannot score data.task='write_program', whose answers "
                          "are tests of programs: set reward.kind=code")
    if cfg.reward.kind != "code" or cfg.reward.function is not None:
        return
    if cfg.data.task not in ("write_program", FILES_TASK):
        raise ConfigError(f"reward.kind='code' cannot score data.task={cfg.data.task!r}, whose answers are not tests "
                          "of programs: use data.task='write_program' or files whose answers hold tests")
    try:
        check_box(cfg.reward.code.network)
    except OSError as error:
        allow = "" if cfg.reward.code.network == "allow" else (
            "; reward.code.network=allow runs the programs without a network namespace of their own")
        raise ConfigError(f"reward.kind='code' with reward.code.network={cfg.reward.code.network!r}: the model's "
                          f"programs cannot be boxed here ({' '.join(str(error).split())}){allow}") from None
