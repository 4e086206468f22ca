"""``write_program``: a small built-in code task, scored by running the response's program (``reward.kind: code``).

Each prompt asks for a Python program that reads standard input and prints an answer (``sum``: the sum of the
integers on its line; ``reverse``: the line reversed; ``max``: the largest integer; ``count``: how many integers),
and ends ``Answer with a Python program in a fenced block.``; the answer is the row's tests as verl-style code
datasets keep them, a JSON object ``{"inputs": [...], "outputs": [...]}`` of stdin / stdout pairs. A response earns
the fraction of the tests its last fenced block passes (:mod:`jppo.rewards.code`, in a box:
:mod:`jppo.rewards.sandbox`). The vocabulary is printable ASCII and the newline, so that a tiny model can spell
any program; it is here for the tests, the docs and ``configs/quickstart_code.yaml``, not to be learnt quickly.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import string
from typing import Optional

from jppo.data.tasks import BUILTIN_TASKS, Example, _generate, _is_int

PROBLEMS = {
    "sum": ("prints the sum of the integers on the line", lambda xs: str(sum(xs))),
    "reverse": ("prints the line reversed", None),
    "max": ("prints the largest of the integers on the line", lambda xs: str(max(xs))),
    "count": ("prints how many integers the line holds", lambda xs: str(len(xs))),
}
FENCED = re.compile(r"```[A-Za-z0-9_+-]*[ \t]*\n(.*?)```", re.DOTALL)


@BUILTIN_TASKS.register("write_program")
@dataclasses.dataclass(frozen=True)
class WriteProgram:
    """A program that reads one line of integers separated by spaces and prints one answer; ``tests`` stdin /
    stdout pairs per prompt, of up to ``max_numbers`` integers each."""

    tests: int = 3
    max_numbers: int = 5
    open_block: bool = False  # the prompt ends by opening the fenced block, which the response continues
    name: str = dataclasses.field(default="write_program", init=False)
    alphabet: str = dataclasses.field(
        default="".join(sorted(set(string.printable) - set("\r\x0b\x0c\t"))), init=False
    )

    def __post_init__(self) -> None:
        for key, value in (("tests", self.tests), ("max_numbers", self.max_numbers)):
            if not (_is_int(value) and 1 <= value <= 50):
                raise ValueError(f"data.task_options {key}={value!r} is invalid for task 'write_program': it must "
                                 "be an integer in [1, 50]")
        if not isinstance(self.open_block, bool):
            raise ValueError(f"data.task_options open_block={self.open_block!r} is invalid for task 'write_program': "
                             "it must be true or false")

    def _draw(self, rng: random.Random) -> tuple[str, str]:
        kind = rng.choice(sorted(PROBLEMS))
        what, answer = PROBLEMS[kind]
        lines = [[rng.randint(-99, 99) for _ in range(rng.randint(1, self.max_numbers))] for _ in range(self.tests)]
        inputs = [" ".join(map(str, xs)) + "\n" for xs in lines]
        outputs = [(text.strip()[::-1] if answer is None else answer(xs)) + "\n" for text, xs in zip(inputs, lines)]
        prompt = (f"Write a Python program that reads one line of integers separated by spaces from standard input "
                  f"and {what}. For example, for {inputs[0].strip()!r} it prints {outputs[0].strip()!r}. Answer "
                  "with a Python program in a fenced block.\n" + ("```python\n" if self.open_block else ""))
        return prompt, json.dumps({"inputs": inputs, "outputs": outputs})

    def examples(self, split: str, n: int, seed: int) -> list[Example]:
        return _generate(self.name, split, n, seed, self._draw)

    def score(self, response_text: str, example: Example, finished: bool = True) -> float:
        raise ValueError("task 'write_program' is scored by running its programs: set reward.kind=code")

    def follows_format(self, response_text: str) -> bool:
        return program_of(response_text, "```python\n" if self.open_block else "") is not None


def program_of(response: str, prompt: str = "") -> Optional[str]:
    """The response's program: its last fenced block (three backticks, an optional language, a newline ... three
    backticks); None when it has none. When the prompt opens a block (it holds an odd number of fences), the
    response continues it: the program is its text up to the first fence that closes it (all of it without one)."""
    if prompt.count("```") % 2 == 1:
        return response.split("```", 1)[0]
    blocks = FENCED.findall(response)
    return blocks[-1] if blocks else None
