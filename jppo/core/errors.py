"""The errors a configuration problem is reported with.

:class:`InvalidSetting` is what a component raises for one setting outside its valid range. It carries the
setting's name, its value and the valid range as well as the one-line message, so the trainer's config validator
(:mod:`jppo.config.check`) can run a component's own check before anything is built and report the failure under the
config key that holds the setting (``rollout.val_n`` for the validation sampler's ``SamplingParams.n``): one
limit, stated once, in the component that relies on it.

:class:`ConfigError` is what the trainer's configuration raises: one line naming the key and the value as the user
wrote them; the command-line entry points print it and exit with status 2, before anything is compiled.

:class:`RewardFunctionError` is what a reward function's failure at run time is reported with (the function and,
where known, the sample it failed on).
"""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A configuration problem, stated in one line that names the key and the value."""


class InvalidSetting(ValueError):
    """``{owner}{name}={value!r} is invalid: it must be {valid}``; ``owner`` is how the component names itself
    (``"SamplingParams."``, ``"policy loss 'vanilla' option "``)."""

    def __init__(self, owner: str, name: str, value: Any, valid: str):
        self.owner, self.name, self.value, self.valid = owner, name, value, valid
        super().__init__(f"{owner}{name}={value!r} is invalid: it must be {valid}")

    def renamed(self, key: str) -> str:
        """The same message under another name (a config key)."""
        return f"{key}={self.value!r} is invalid: it must be {self.valid}"


class RewardFunctionError(RuntimeError):
    """A reward function failed or returned something unusable; the message names it and, if known, the sample."""


def error_line(error: BaseException) -> str:
    """An error's type and message on one line (``ValueError: ...``): what a user's own code raised."""
    return f"{type(error).__name__}: " + " ".join(str(error).split())


def one_line(error: Exception) -> str:
    """An error's message on one line (what the command-line entry points print). A ``KeyError``'s own ``str``
    quotes its message; its message is taken as written."""
    text = error.args[0] if isinstance(error, KeyError) and error.args else error
    return " ".join(str(text).split())
