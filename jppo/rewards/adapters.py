"""Reward functions written for other trainers, called through jppo's plug-in interface (``reward.function_style``).

Each adapter turns a user's function into ``fn(responses, examples) -> list[float]``, the form a jppo plug-in has:

- ``verl``: ``compute_score(data_source, solution_str, ground_truth, extra_info)``, called once per response with
  keyword arguments, as verl's reward manager calls it: ``solution_str`` is the decoded response,
  ``ground_truth`` the example's answer (``data.answer_key``, e.g. ``reward_model.ground_truth``), ``data_source``
  and ``extra_info`` the row's columns of those names (``""`` and ``{}`` when absent). It returns a number, or a
  dict whose ``"score"`` is the reward (verl's convention; the dict's other keys are ignored).
- ``trl``: ``fn(completions, **kwargs) -> list[float | None]``, called once per batch, as TRL's GRPO trainer calls
  it: ``completions`` the decoded responses, ``prompts`` the prompts (the row's chat messages when it has them,
  else the text), ``ground_truth`` the answers, and every other column of the rows under its own name, each a list
  with one entry per response (``None`` where a row lacks the column). ``None`` in the result means "no reward":
  it scores 0, and the number of such responses is logged.
"""

from __future__ import annotations

import inspect
import logging
import numbers
from typing import Any, Callable

from jppo.core.errors import RewardFunctionError
from jppo.data.tasks import Example

VERL_ARGUMENTS = ("data_source", "solution_str", "ground_truth", "extra_info")
_LOG = logging.getLogger(__name__)

Adapted = Callable[[list[str], list[Example]], list[float]]


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real)  # int, float, bool and numpy scalars


def check_signature(function: Callable[..., Any], style: str, spec: str) -> None:
    """A function that cannot take the arguments its style passes is refused when it is loaded, not mid-run."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # built-ins without a signature: left to the first call
        return
    if style == "verl":
        try:
            signature.bind(**dict.fromkeys(VERL_ARGUMENTS))
        except TypeError:
            raise ValueError(
                f"reward.function={spec!r} with reward.function_style='verl' must take the keyword arguments "
                f"{', '.join(VERL_ARGUMENTS)}; its signature is {signature}"
            ) from None
    if style == "trl":
        takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
        try:
            signature.bind_partial([])  # completions come first, positionally
        except TypeError:
            takes_kwargs = False
        if not takes_kwargs:
            raise ValueError(
                f"reward.function={spec!r} with reward.function_style='trl' must take (completions, **kwargs); "
                f"its signature is {signature}"
            )


def verl_adapter(function: Callable[..., Any], spec: str) -> Adapted:
    """``compute_score`` called per response; a number or a dict's ``"score"`` is its reward."""

    def scores(responses: list[str], examples: list[Example]) -> list[float]:
        values = []
        for index, (text, example) in enumerate(zip(responses, examples)):
            extra_info = example.meta.get("extra_info")
            result = function(
                data_source=example.meta.get("data_source", ""), solution_str=text, ground_truth=example.answer,
                extra_info=extra_info if isinstance(extra_info, dict) else {},
            )
            values.append(_verl_score(result, spec, index))
        return values

    return scores


def _verl_score(result: Any, spec: str, index: int) -> float:
    score = result.get("score") if isinstance(result, dict) else result
    if not _is_real(score):
        got = f"a dict without a number under 'score' ({sorted(result)})" if isinstance(result, dict) else (
            f"{type(result).__name__} {str(result)[:60]!r}")
        raise RewardFunctionError(
            f"reward.function {spec} returned {got} for sample {index}; a verl compute_score returns a number or "
            "a dict with a numeric 'score'"
        )
    return float(score)


def trl_columns(examples: list[Example]) -> dict[str, list[Any]]:
    """The keyword arguments of a TRL reward function: the rows' columns as lists, one entry per response."""
    names = sorted({name for example in examples for name in example.meta if name != "location"})
    columns = {name: [example.meta.get(name) for example in examples] for name in names}
    columns["prompts"] = [example.messages if example.messages is not None else example.prompt for example in examples]
    columns["ground_truth"] = [example.answer for example in examples]
    return columns


def trl_adapter(function: Callable[..., Any], spec: str) -> Adapted:
    """``fn(completions, **columns)`` called per batch; ``None`` rewards score 0 and are counted in the log."""

    def scores(responses: list[str], examples: list[Example]) -> list[float]:
        result = function(list(responses), **trl_columns(examples))
        values = _trl_scores(result, len(responses), spec)
        unscored = sum(value is None for value in values)
        if unscored:
            _LOG.warning("reward.function %s gave no reward (None) to %d of %d responses; they score 0",
                         spec, unscored, len(values))
        return [0.0 if value is None else float(value) for value in values]

    return scores


def _trl_scores(result: Any, expected: int, spec: str) -> list[Any]:
    if not isinstance(result, (list, tuple)) and not (hasattr(result, "tolist") and getattr(result, "ndim", 0) == 1):
        raise RewardFunctionError(
            f"reward.function {spec} returned {type(result).__name__} {str(result)[:60]!r}; a TRL reward function "
            "returns a list with one float (or None) per completion"
        )
    values = list(result.tolist() if hasattr(result, "tolist") else result)
    if len(values) != expected:
        raise RewardFunctionError(f"reward.function {spec} returned {len(values)} rewards for {expected} completions")
    for index, value in enumerate(values):
        if value is not None and not _is_real(value):
            raise RewardFunctionError(
                f"reward.function {spec} returned {type(value).__name__} {str(value)[:40]!r} for sample {index}; "
                "each reward must be a float or None"
            )
    return values


ADAPTERS = {"verl": verl_adapter, "trl": trl_adapter}
