"""Built-in tasks: prompt generators with their scorers, deterministic given a seed, nothing downloaded.

A task has a ``name``, an ``alphabet`` (the characters of its built-in tokenizer; ``None`` when it needs a Hugging
Face tokenizer), ``examples(split, n, seed)``, ``score(response_text, example) -> float in [0, 1]`` and
``follows_format(response_text) -> bool`` (the shape of a well-formed answer, used by the optional format reward).

Train and validation prompts of the generated tasks are disjoint by construction: a prompt belongs to the
validation split when a CRC-32 of its text is divisible by 10, whatever the seed or the number of examples asked,
so no validation prompt is ever trained on.

- ``reverse_digits`` (the quickstart task): prompt ``"3051="``, answer ``"1503"``, reward the per-position match.
- ``add_small``: prompt ``"17+5="``, answer ``"22"``, reward the per-digit-place match.
- ``tool_multiply``: prompt ``"37*58="``, answer ``"2146"``, for a calculator environment (``rollout.env:
  builtin:calculator``): the expected response ``[37*58]=2146;2146`` calls the tool, reads its result, answers;
  with ``call_hint`` the prompt opens the call (``"37*58=[37*58"``) and the expected response is ``]=2146;2146``.
- ``reasoning_gym:<dataset>``: a dataset of the optional package ``reasoning-gym``, scored by its own
  ``score_answer`` on the text between the last ``<answer>`` and ``</answer>`` of the response.

A new built-in task is a class decorated with ``@BUILTIN_TASKS.register(name)`` (its ``name`` field the same name).
"""

from __future__ import annotations

import dataclasses
import random
import re
import zlib
from typing import Any, Callable, Optional, Protocol

from jppo.core.checks import register_config_check
from jppo.core.errors import ConfigError
from jppo.core.inputs import FILES_TASK, REASONING_GYM_PREFIX
from jppo.core.registry import Registry

SPLITS = ("train", "val")
# The built-in tasks by name: each task class registers itself with ``@BUILTIN_TASKS.register(name)``.
BUILTIN_TASKS: Registry[type[Task]] = Registry(
    "task",
    lambda name, names: (
        f"data.task={name!r} is unknown; valid tasks: {sorted(names)}, '{REASONING_GYM_PREFIX}<dataset>'"
    ),
)


@register_config_check("data.task")
def check_task_name(cfg) -> None:
    """``data.task`` is a built-in task, ``reasoning_gym:<dataset>`` or ``files``; a generated task without
    ``model.path`` needs a tokenizer unless it is built in (its character vocabulary)."""
    task = cfg.data.task
    if not (task in (FILES_TASK, *BUILTIN_TASKS) or task.startswith(REASONING_GYM_PREFIX)):
        raise ConfigError(f"data.task={task!r} is unknown; valid tasks: {sorted(BUILTIN_TASKS)}, "
                          f"'{REASONING_GYM_PREFIX}<dataset>', '{FILES_TASK}'")
    if cfg.model.path is None and cfg.model.tokenizer is None and task not in BUILTIN_TASKS:
        raise ConfigError(f"model.tokenizer is required for data.task={task!r} without model.path (built-in "
                          f"vocabularies exist for: {', '.join(BUILTIN_TASKS)})")


_HELD_OUT_MODULUS = 10  # one prompt in ten is reserved for validation
_MAX_DRAWS_PER_EXAMPLE = 100  # a split holding under ~1% of a task's prompts is an error, not an endless loop


@dataclasses.dataclass(frozen=True)
class Example:
    """One prompt with its reference answer.

    Attributes:
        prompt: the prompt text (for a chat row, the content of its last user message).
        answer: the reference answer as text (GSM8K-style ``"... #### 42"`` is kept whole; rewards extract).
        meta: extras a scorer or a reward plug-in may use (e.g. the reasoning-gym entry, the other columns of a row).
        messages: the chat messages to render with the tokenizer's chat template, when the source gave messages.
    """

    prompt: str
    answer: str
    meta: dict = dataclasses.field(default_factory=dict)
    messages: Optional[list[dict]] = None


class Task(Protocol):
    name: str
    alphabet: Optional[str]

    def examples(self, split: str, n: int, seed: int) -> list[Example]: ...

    def score(self, response_text: str, example: Example, finished: bool = True) -> float: ...

    def follows_format(self, response_text: str) -> bool: ...


def is_held_out(prompt: str) -> bool:
    """Whether a generated prompt belongs to the validation split."""
    return zlib.crc32(prompt.encode("utf-8")) % _HELD_OUT_MODULUS == 0


def positional_credit(response: str, answer: str, finished: bool = True) -> list[float]:
    """Credit of each produced token for spelling ``answer``: character i of the response earns
    ``1 / len(answer)`` when it equals ``answer[i]``; what follows the answer (and the EOS) earns nothing.

    So a response earns exactly 1 when it starts with the answer, and every credit is decided by the token at
    that position alone, which lets ``reward.token_level`` pay each token as it is produced. Stopping is not
    scored: an untrained policy's EOS mostly cuts answers short, so a reward for stopping at the right place
    is learnt only long after the digits (measured: the default config then stalls near 0.3). Returns one
    credit per character of ``response``, plus one (0) for the EOS when ``finished``.
    """
    unit = 1.0 / max(len(answer), 1)
    credit = [unit if i < len(answer) and c == answer[i] else 0.0 for i, c in enumerate(response)]
    return credit + [0.0] if finished else credit


def positional_match(response: str, answer: str, finished: bool = True) -> float:
    """Fraction of the answer's characters that the response has in place (1 when it starts with the answer)."""
    return sum(positional_credit(response, answer, finished))


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is invalid: valid splits are {list(SPLITS)}")


def _generate(
    task_name: str, split: str, n: int, seed: int, draw: Callable[[random.Random], tuple[str, str]]
) -> list[Example]:
    """``n`` examples of one split, drawn with replacement from a stream seeded by (task, split, seed)."""
    _check_split(split)
    if n < 0:
        raise ValueError(f"number of examples n={n} is invalid: it must be >= 0")
    rng = random.Random(f"{task_name}:{split}:{seed}")
    want_held_out = split == "val"
    examples: list[Example] = []
    for _ in range(_MAX_DRAWS_PER_EXAMPLE * n):
        if len(examples) == n:
            break
        prompt, answer = draw(rng)
        if is_held_out(prompt) == want_held_out:
            examples.append(Example(prompt=prompt, answer=answer))
    if len(examples) < n:
        raise ValueError(f"task {task_name!r} has too few distinct prompts for a {split} split: widen its options")
    return examples


def _is_int(value: Any) -> bool:
    """An integer option, and not a boolean (``true`` is an ``int`` to Python, but not a length)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_digits(text: str) -> bool:
    return bool(re.fullmatch(r"[0-9]+", text))


class _DigitAnswerTask:
    """A generated task whose answer is a digit string, scored by :func:`positional_match`."""

    name: str

    def _draw(self, rng: random.Random) -> tuple[str, str]:
        raise NotImplementedError

    def examples(self, split: str, n: int, seed: int) -> list[Example]:
        return _generate(self.name, split, n, seed, self._draw)

    def score(self, response_text: str, example: Example, finished: bool = True) -> float:
        return positional_match(response_text, example.answer, finished)

    def credit(self, response_text: str, example: Example, finished: bool = True) -> list[float]:
        """Per-token credit summing to :meth:`score` (for ``reward.token_level``)."""
        return positional_credit(response_text, example.answer, finished)

    def follows_format(self, response_text: str) -> bool:
        return _is_digits(response_text)


@BUILTIN_TASKS.register("reverse_digits")
@dataclasses.dataclass(frozen=True)
class ReverseDigits(_DigitAnswerTask):
    """Reverse a digit string: prompt ``"3051="``, answer ``"1503"``, then EOS.

    Reward: :func:`positional_match`, the fraction of the answer's digits the response has in place. A uniform
    random policy earns about 1/14 per position, so there is signal from the first step.
    """

    min_len: int = 3
    max_len: int = 5
    name: str = dataclasses.field(default="reverse_digits", init=False)
    alphabet: str = dataclasses.field(default="0123456789=", init=False)

    def __post_init__(self) -> None:
        if not (_is_int(self.min_len) and _is_int(self.max_len) and 1 <= self.min_len <= self.max_len):
            raise ValueError(
                f"data.task_options min_len={self.min_len!r}, max_len={self.max_len!r} are invalid for task "
                "'reverse_digits': they must be integers with 1 <= min_len <= max_len"
            )

    def _draw(self, rng: random.Random) -> tuple[str, str]:
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(self.min_len, self.max_len)))
        return digits + "=", digits[::-1]



@BUILTIN_TASKS.register("add_small")
@dataclasses.dataclass(frozen=True)
class AddSmall(_DigitAnswerTask):
    """Add two small numbers: prompt ``"17+5="``, answer ``"22"``, then EOS.

    Reward: :func:`positional_match` against the sum's digits, left to right (1 when the response starts with
    the sum).
    """

    max_operand: int = 99
    name: str = dataclasses.field(default="add_small", init=False)
    alphabet: str = dataclasses.field(default="0123456789+=", init=False)

    def __post_init__(self) -> None:
        if not (_is_int(self.max_operand) and self.max_operand >= 1):
            raise ValueError(
                f"data.task_options max_operand={self.max_operand!r} is invalid for task 'add_small': it must be an "
                "integer >= 1"
            )

    def _draw(self, rng: random.Random) -> tuple[str, str]:
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        return f"{a}+{b}=", str(a + b)



_CALCULATOR_RESULT = re.compile(r"\]=[-0-9?]*;")  # a call's end and the calculator's observation


@BUILTIN_TASKS.register("tool_multiply")
@dataclasses.dataclass(frozen=True)
class ToolMultiply:
    """Multiply two numbers with a calculator tool: prompt ``"37*58="``, answer ``"2146"`` (operands of
    ``left_digits`` and ``right_digits`` digits).

    The response the task expects is ``[37*58]`` (a tool call, ended by the calculator's stop token ``]``), the
    calculator's observation ``=2146;`` and the answer ``2146`` then EOS. The answer is the text after the last
    calculator result (``]`` then ``=VALUE;``; all of the text when there is none; a ``;`` the model types opens
    nothing). Score: ``call_weight`` x the positional match of the text up to the first ``]`` with the expected
    call (the first model turn: observations only follow a ``]``) plus ``1 - call_weight`` x the positional match
    of the answer; credit is paid per character of those two spans, so nothing lands on observation characters.
    Without the tool a random policy guesses a 4-digit product at ~1/10 per digit.

    ``call_hint``: the prompt suggests the call by opening it, ``"37*58=[37*58"``; the expected call is then the
    ``]`` that closes it (the calculator reads a call that opens in the prompt), so the expected response is
    ``]=2146;2146``: one token calls the tool, and its result is read back by copying each digit of the
    observation from a fixed distance back. A small ``call_weight`` is needed as a start: with 0 (the answer's
    digits only) a direct answer pays as much as a call until copying is learnt, and its leading digit is learnt
    first, so the policy drops the call before it can learn to read it back (measured, README's multi-turn part).
    """

    left_digits: int = 2
    right_digits: int = 2
    call_weight: float = 0.5
    call_hint: bool = False
    name: str = dataclasses.field(default="tool_multiply", init=False)
    alphabet: str = dataclasses.field(default="0123456789+-*=[];?", init=False)

    def __post_init__(self) -> None:
        for key in ("left_digits", "right_digits"):
            value = getattr(self, key)
            if not (_is_int(value) and 1 <= value <= 6):
                raise ValueError(
                    f"data.task_options {key}={value!r} is invalid for task 'tool_multiply': it must be an integer in "
                    "[1, 6]"
                )
        if not (isinstance(self.call_weight, (int, float)) and 0 <= self.call_weight <= 1):
            raise ValueError(
                f"data.task_options call_weight={self.call_weight!r} is invalid for task 'tool_multiply': it must be "
                "in [0, 1]"
            )
        if not isinstance(self.call_hint, bool):
            raise ValueError(
                f"data.task_options call_hint={self.call_hint!r} is invalid for task 'tool_multiply': it must be true "
                "or false"
            )

    def _draw(self, rng: random.Random) -> tuple[str, str]:
        """Operands of exactly ``left_digits`` and ``right_digits`` digits whose product has exactly
        ``left_digits + right_digits`` digits (redrawn until it does), so every prompt, call, observation and
        answer of the task has the same length."""
        while True:
            a = rng.randint(10 ** (self.left_digits - 1), 10**self.left_digits - 1)
            b = rng.randint(10 ** (self.right_digits - 1), 10**self.right_digits - 1)
            if len(str(a * b)) == self.left_digits + self.right_digits:
                question = f"{a}*{b}="
                return (question + f"[{a}*{b}" if self.call_hint else question), str(a * b)

    def expected_call(self, example: Example) -> str:
        """The call the first model turn should be: ``[37*58]``, or with ``call_hint`` the ``]`` closing the prompt's
        open call."""
        return "]" if self.call_hint else f"[{example.prompt[: example.prompt.index('=')]}]"

    def examples(self, split: str, n: int, seed: int) -> list[Example]:
        return _generate(self.name, split, n, seed, self._draw)

    def credit(self, response_text: str, example: Example, finished: bool = True) -> list[float]:
        """Per-character credit (plus one, 0, for the EOS when ``finished``) summing to :meth:`score`."""
        call, answer = self.expected_call(example), example.answer
        call_end = response_text.index("]") + 1 if "]" in response_text else 0
        results = list(_CALCULATOR_RESULT.finditer(response_text))
        answer_start = results[-1].end() if results else 0
        credit = [0.0] * len(response_text)
        for i, c in enumerate(response_text[:call_end]):
            credit[i] = self.call_weight / len(call) if i < len(call) and c == call[i] else 0.0
        tail = positional_credit(response_text[answer_start:], answer, finished=False)
        for i, value in enumerate(tail):
            credit[answer_start + i] += (1.0 - self.call_weight) * value
        return credit + [0.0] if finished else credit

    def score(self, response_text: str, example: Example, finished: bool = True) -> float:
        return sum(self.credit(response_text, example, finished))

    def follows_format(self, response_text: str) -> bool:
        results = list(_CALCULATOR_RESULT.finditer(response_text))
        return _is_digits(response_text[results[-1].end() if results else 0 :])


_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_REASONING_GYM_INSTRUCTION = "\nWrite only the final answer between <answer> and </answer>."


def extract_answer_tag(response_text: str) -> Optional[str]:
    """The stripped text between the last ``<answer>`` and its ``</answer>``, or ``None``."""
    matches = _ANSWER_TAG.findall(response_text)
    return matches[-1].strip() if matches else None


class ReasoningGymTask:
    """A procedural dataset of ``reasoning-gym``, generated offline and scored by the dataset's own rule.

    The prompt is the dataset's question followed by an instruction to answer between ``<answer>`` tags; the score
    is ``score_answer(<text in the last answer tags, or None>, entry)``. ``options`` are the dataset's config fields
    (e.g. ``min_terms`` for ``basic_arithmetic``); ``size`` and ``seed`` are set by jppo.
    """

    alphabet = None

    def __init__(self, dataset: str, options: Optional[dict[str, Any]] = None):
        try:
            import reasoning_gym  # noqa: PLC0415 (an optional extra: reasoning_gym tasks only)
        except ImportError:
            raise ValueError(
                f"task {REASONING_GYM_PREFIX}{dataset} needs the optional package reasoning-gym: "
                "pip install 'jppo[tasks]' (or pip install reasoning-gym)"
            ) from None
        registry = reasoning_gym.factory.DATASETS
        if dataset not in registry:
            raise ValueError(f"reasoning-gym has no dataset {dataset!r}; valid datasets: {sorted(registry)}")
        options = dict(options or {})
        config_fields = {field.name for field in dataclasses.fields(registry[dataset][1])} - {"size", "seed"}
        unknown = sorted(set(options) - config_fields)
        if unknown:
            raise ValueError(
                f"data.task_options {unknown} are not options of reasoning-gym dataset {dataset!r}; "
                f"valid options: {sorted(config_fields)}"
            )
        self.name = REASONING_GYM_PREFIX + dataset
        self._dataset = dataset
        self._options = options
        self._create = reasoning_gym.create_dataset
        self._scorer = self._create(dataset, size=1, seed=0, **options).score_answer  # also validates the options

    def examples(self, split: str, n: int, seed: int) -> list[Example]:
        _check_split(split)
        split_seed = zlib.crc32(f"{self.name}:{split}:{seed}".encode("utf-8"))
        source = self._create(self._dataset, size=max(1, _MAX_DRAWS_PER_EXAMPLE * n), seed=split_seed, **self._options)
        examples: list[Example] = []
        for index in range(len(source)):
            if len(examples) == n:
                break
            entry = source[index]
            prompt = entry["question"] + _REASONING_GYM_INSTRUCTION
            if is_held_out(prompt) == (split == "val"):
                examples.append(Example(prompt=prompt, answer=str(entry["answer"]), meta={"entry": entry}))
        if len(examples) < n:
            raise ValueError(f"task {self.name!r} has too few distinct prompts for a {split} split: widen its options")
        return examples

    def score(self, response_text: str, example: Example, finished: bool = True) -> float:
        del finished  # the answer tags decide
        return float(self._scorer(extract_answer_tag(response_text), example.meta["entry"]))

    def follows_format(self, response_text: str) -> bool:
        return extract_answer_tag(response_text) is not None


def get_task(name: str, options: Optional[dict[str, Any]] = None) -> Task:
    """The task called ``name`` (a built-in name or ``"reasoning_gym:<dataset>"``), built with ``options``."""
    if name.startswith(REASONING_GYM_PREFIX):
        return ReasoningGymTask(name[len(REASONING_GYM_PREFIX) :], options)
    task_class = BUILTIN_TASKS.lookup(name)
    valid = sorted(field.name for field in dataclasses.fields(task_class) if field.init)
    unknown = sorted(set(options or {}) - set(valid))
    if unknown:
        raise ValueError(f"data.task_options {unknown} are not options of task {name!r}; valid options: {valid}")
    return task_class(**(options or {}))
