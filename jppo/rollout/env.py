"""Environments for multi-turn rollouts: the interface, the loader (``rollout.env``) and the built-in calculator.

An environment answers the model between its turns. ``rollout.env`` names a callable that makes one fresh
environment per response (``path/to/file.py:make_env``, ``package.module:make_env``, as reward plug-ins are named,
or ``builtin:<name>`` for one registered in :data:`BUILTIN_ENVS`). An environment has::

    stop: tuple[str, ...]                      # texts that end a model turn (each must be ONE token), e.g. ("]",)
    reset(prompt: str, example) -> str         # called once; its observation is appended to the prompt (both
                                               # within data.max_prompt_length tokens)
    step(action: str) -> (str, float, bool)    # a model turn's text -> (observation, reward, done)

A model turn ends at EOS or at a ``stop`` token; either way its text (special tokens dropped) goes to ``step``,
whose reward lands on the turn's last token. The observation is appended to the response (attended by later turns,
masked out of every loss) unless ``done``, the turn ended at EOS, or ``rollout.max_turns`` turns were taken.
:mod:`jppo.rollout.multiturn` runs the loop.
"""

from __future__ import annotations

import ast
import dataclasses
import operator
import re
from typing import Any, Callable, Protocol

from jppo.core.inputs import BUILTIN_PREFIX  # one spelling of built-in names, for tasks and environments
from jppo.core.plugins import load_function
from jppo.core.registry import Registry

KEY = "rollout.env"


class Environment(Protocol):
    stop: tuple[str, ...]

    def reset(self, prompt: str, example: Any) -> str: ...

    def step(self, action: str) -> tuple[str, float, bool]: ...


EnvFactory = Callable[[], Environment]
# The built-in environments, ``rollout.env: builtin:<name>``: each factory registers itself with
# ``@BUILTIN_ENVS.register(name)`` where it is defined.
BUILTIN_ENVS: Registry[EnvFactory] = Registry(
    "environment",
    lambda name, names: (
        f"{KEY}={BUILTIN_PREFIX + name!r} is unknown; built-in environments: {[BUILTIN_PREFIX + n for n in names]}"
    ),
)

_EXPRESSION = re.compile(r"[0-9+\-* ]{1,40}")
_OPERATIONS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
_MAX_RESULT = 10**15


def evaluate(expression: str) -> int | None:
    """The integer value of ``expression`` (integers with ``+``, ``-``, ``*``, usual precedence), or ``None`` when
    it is not such an expression or its value has more than 15 digits. Parsed, never executed."""
    if not _EXPRESSION.fullmatch(expression):
        return None
    try:
        tree = ast.parse(expression.strip(), mode="eval").body
    except SyntaxError:
        return None

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            if node.value >= _MAX_RESULT:
                raise OverflowError
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATIONS:
            left, right = value(node.left), value(node.right)
            result = _OPERATIONS[type(node.op)](left, right)
            if abs(result) >= _MAX_RESULT:
                raise OverflowError
            return result
        raise ValueError

    try:
        return value(tree)
    except (ValueError, OverflowError):
        return None


@BUILTIN_ENVS.register("calculator")
@dataclasses.dataclass
class Calculator:
    """A calculator tool: a turn ending in ``[EXPR]`` is a call, answered with ``=VALUE;`` (``=?;`` when ``EXPR``
    is not an integer expression of ``+ - *``). A turn that ends otherwise (EOS) is the final answer: done.
    Rewards are 0; the task's reward scores the answer.

    The ``[`` may come before the turn, in the prompt or an earlier turn (a prompt may open the call for the model
    to close: ``"7*58=[7*58"`` then ``"]"``): the call is the text between the last ``[`` and the ``]`` that
    ends the turn, read over the prompt and the response so far, which the calculator keeps. A ``]`` with no
    ``[`` since the previous ``]`` calls nothing: done."""

    stop: tuple[str, ...] = ("]",)
    context: str = ""  # the prompt and the response so far (model turns and observations)

    def reset(self, prompt: str, example: Any) -> str:
        self.context = prompt
        return ""

    def step(self, action: str) -> tuple[str, float, bool]:
        self.context += action
        end = len(self.context) - 1
        opened = self.context.rfind("[", 0, end)
        if not action.endswith("]") or opened < 0 or opened < self.context.rfind("]", 0, end):
            return "", 0.0, True
        result = evaluate(self.context[opened + 1 : -1])
        observation = f"={'?' if result is None else result};"
        self.context += observation
        return observation, 0.0, False


def load_env(spec: str) -> EnvFactory:
    """The environment factory ``rollout.env`` names, checked on one instance; problems are one-line ValueErrors
    naming ``rollout.env``."""
    if spec.startswith(BUILTIN_PREFIX):
        factory = BUILTIN_ENVS.lookup(spec[len(BUILTIN_PREFIX) :])
    else:
        factory = load_function(spec, KEY)
    try:
        env = factory()
    except Exception as error:
        raise ValueError(f"{KEY}={spec!r}: making an environment raised {type(error).__name__}: {error}") from error
    missing = [name for name in ("reset", "step") if not callable(getattr(env, name, None))]
    stop = getattr(env, "stop", ())
    if missing or not isinstance(stop, (tuple, list)) or not all(isinstance(s, str) and s for s in stop):
        raise ValueError(
            f"{KEY}={spec!r} made a {type(env).__name__} without {missing or 'a stop tuple of non-empty texts'}: an "
            "environment needs reset(prompt, example), step(action) and stop"
        )
    return factory


def stop_token_ids(factory: EnvFactory, tokenizer, spec: str = "") -> tuple[int, ...]:
    """The token ids of the environment's ``stop`` texts; each must be one token of ``tokenizer`` (the sampler
    ends a turn at a token, not inside one)."""
    ids = []
    for text in factory().stop:
        try:
            tokens = tokenizer.encode(text, add_special_tokens=False)
        except ValueError as error:
            raise ValueError(f"{KEY}={spec!r}: its stop text {text!r} cannot be encoded ({error})") from error
        if len(tokens) != 1:
            raise ValueError(f"{KEY}={spec!r}: its stop text {text!r} is {len(tokens)} tokens; each must be one token")
        ids.append(tokens[0])
    return tuple(ids)
