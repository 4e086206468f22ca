"""Reward plug-ins: a Python function in a file of your own, named ``reward.function: path/to/file.py:fn``.

The function is called once per batch::

    def fn(responses: list[str], examples: list[jppo.data.Example]) -> Sequence[float] | np.ndarray:
        ...  # one finite float per response; example.prompt, example.answer, example.meta hold the data

If it also takes a parameter named ``finished`` (or ``**kwargs``), it receives ``finished=list[bool]`` too:
``True`` where the response ended with EOS, ``False`` where it was cut at the length limit.

The file is executed once, when the config is validated, as a module of its own (registered in ``sys.modules``
under a private ``jppo_reward_plugin_*`` name; ``sys.path`` is left alone, so the plug-in's own imports resolve
as in any script: installed packages, not the plug-in's folder). A relative path is relative to the working
directory. When the batch call raises, the function is called again sample by sample to name the failing one.

The function may also come from an installed module, ``package.module:fn`` (a name that is not an existing path
nor ends in ``.py``). A function written for verl (``compute_score``) or TRL (``fn(completions, **kwargs)``)
plugs in as it is with ``reward.function_style: verl`` or ``trl`` (see :mod:`jppo.rewards.adapters`).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Sequence

import numpy as np

from jppo.core.errors import RewardFunctionError, error_line
from jppo.core.plugins import load_function
from jppo.rewards.adapters import ADAPTERS, check_signature


@dataclasses.dataclass(frozen=True)
class RewardPlugin:
    """A loaded ``reward.function``: call it with ``(responses, examples, finished)`` for float32 rewards ``[B]``."""

    function: Callable[..., Any]
    spec: str
    pass_finished: bool  # the function takes ``finished=`` (a parameter of that name, or ``**kwargs``)

    def _call(self, responses: list[str], examples: list, finished: Sequence[bool]) -> Any:
        extra = {"finished": [bool(f) for f in finished]} if self.pass_finished else {}
        return self.function(list(responses), list(examples), **extra)

    def __call__(self, responses: list[str], examples: list, finished: Sequence[bool]) -> np.ndarray:
        try:
            result = self._call(responses, examples, finished)
        except RewardFunctionError:  # an adapter's check of what the function returned: already names it
            raise
        except Exception as batch_error:
            for index in range(len(responses)):
                try:
                    self._call([responses[index]], [examples[index]], [finished[index]])
                except Exception as error:
                    raise RewardFunctionError(
                        f"reward.function {self.spec} raised {error_line(error)} on sample {index} "
                        f"(response {responses[index][:80]!r})"
                    ) from error
            raise RewardFunctionError(
                f"reward.function {self.spec} raised {error_line(batch_error)} on a batch of {len(responses)}, "
                "though each sample alone succeeds"
            ) from batch_error
        return self._checked(result, len(responses))

    def _checked(self, result: Any, expected: int) -> np.ndarray:
        try:
            rewards = np.asarray(result, dtype=np.float64)
        except (TypeError, ValueError):
            rewards = None
        if rewards is None or rewards.ndim != 1:
            raise RewardFunctionError(
                f"reward.function {self.spec} returned {type(result).__name__} {str(result)[:80]!r}; "
                "it must return a list or 1-D array of floats, one per response"
            )
        if len(rewards) != expected:
            raise RewardFunctionError(
                f"reward.function {self.spec} returned {len(rewards)} rewards for {expected} responses"
            )
        bad = np.flatnonzero(~np.isfinite(rewards))
        if bad.size:
            raise RewardFunctionError(
                f"reward.function {self.spec} returned the non-finite reward {rewards[bad[0]]} for sample {int(bad[0])}"
            )
        return rewards.astype(np.float32)


def load_reward_plugin(spec: str, style: str = "jppo") -> RewardPlugin:
    """Loads ``fn`` from ``path/to/file.py:fn`` (or ``package.module:fn``), called as a function of ``style``
    (``jppo``, ``verl`` or ``trl``); errors name ``reward.function`` and the value."""
    function = load_function(spec)
    if style in ADAPTERS:
        check_signature(function, style, spec)
        return RewardPlugin(function=ADAPTERS[style](function, spec), spec=spec, pass_finished=False)
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # some built-in callables have no inspectable signature
        parameters = ()
    pass_finished = any(p.name == "finished" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
    return RewardPlugin(function=function, spec=spec, pass_finished=pass_finished)
