"""Reward calls bounded in time and isolated in processes of their own (jppo.rewards.workers): a row whose scorer
hangs, raises, kills its worker or runs out of memory scores what ``reward.on_error`` says, and every other row
gets exactly the reward the trainer's process computes."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from jppo.core.errors import RewardFunctionError
from jppo.core.inputs import RewardConfig
from jppo.data.tasks import Example, get_task
from jppo.rewards.reward_fn import build_reward_fn
from jppo.rewards.workers import Guarded

PLUGIN = '''
import os, time

LEAKED = []


def score(responses, examples):
    out = []
    for text, example in zip(responses, examples):
        if text == "hang":
            time.sleep(10**6)
        if text == "raise":
            raise ValueError("this row is bad")
        if text == "exit":
            os._exit(3)
        if text == "leak":  # keeps 100 MiB per call, as a scorer with a growing cache would
            LEAKED.append(bytearray(100 * 2**20))
        out.append(len(text) / 7 + len(example.answer))
    return out
'''

BAD = ("hang", "raise", "exit")


@pytest.fixture(scope="module")
def plugin(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("reward_workers") / "scorers.py"
    path.write_text(PLUGIN)
    return f"{path}:score"


def rows(texts: list[str]) -> tuple[list[str], list[Example], list[bool]]:
    return texts, [Example("p", "ab" * (i % 3)) for i in range(len(texts))], [True] * len(texts)


def test_failed_calls_score_zero_and_every_other_row_its_in_process_reward(plugin):
    cfg = RewardConfig(function=plugin, workers=2, timeout_s=2.0, on_error="zero", worker_memory_mb=512)
    in_process = build_reward_fn(cfg, None)
    # four leaks of 100 MiB cannot fit a 512 MiB address space: some calls fail with MemoryError and their
    # workers are replaced; the rows after them are scored by fresh workers
    texts = ["abc", "hang", "abcdef", "raise", "exit", "x" * 10, *["leak"] * 10, "ok", "hang", "fine"]
    responses, examples, finished = rows(texts)
    reward = Guarded(in_process, cfg, None)
    try:
        start = time.monotonic()
        values = reward(responses, examples, finished)
        elapsed = time.monotonic() - start
        tally = reward.drain()
        for worker in reward.pool.workers:  # a preemption notice to the process group is the trainer's to act on
            os.kill(worker.process.pid, signal.SIGTERM)
        again = reward(*rows(["abc", "raise"]))  # the pool lives on after failures and signals
    finally:
        reward.close()
    assert values.dtype == np.float32
    good = [i for i, text in enumerate(texts) if text not in BAD]
    expected = in_process(*([part[i] for i in good] for part in (responses, examples, finished)))
    failed = [i for i in good if values[i] == 0]  # leaks that ran out of memory
    assert 1 <= len(failed) <= 9 and all(texts[i] == "leak" for i in failed)
    kept = [k for k, i in enumerate(good) if i not in failed]
    np.testing.assert_array_equal(values[[good[k] for k in kept]], expected[kept])  # bit for bit
    assert all(values[i] == 0 for i, text in enumerate(texts) if text in BAD)
    assert tally.timeouts == 2 and tally.errors == 2 + len(failed)  # raise, exit, and the leaks' MemoryErrors
    assert elapsed < 30  # two 2 s timeouts, overlapped with the other worker's rows; never the sleep's 10**6 s
    np.testing.assert_array_equal(again, [in_process(*rows(["abc"]))[0], 0.0])
    assert reward.drain().errors == 1  # the row that raises: no worker died of the signal


@pytest.mark.parametrize(
    "texts, message",
    [
        (["abc", "raise"], "failed on sample 1 (response 'raise'): ValueError: this row is bad"),
        (["exit", "abc"], "failed on sample 0 (response 'exit'): its worker died (exit status 3)"),
        (["abc", "a", "hang"], "failed on sample 2 (response 'hang'): timed out after reward.timeout_s=1.0 s"),
    ],
)
def test_under_raise_a_failed_call_stops_the_run_in_one_line(plugin, texts, message):
    cfg = RewardConfig(function=plugin, workers=1, timeout_s=1.0)
    reward = Guarded(build_reward_fn(cfg, None), cfg, None)
    try:
        with pytest.raises(RewardFunctionError) as error:
            reward(*rows(texts))
    finally:
        reward.close()
    assert str(error.value) == f"reward.function={plugin} {message}"


def test_in_the_trainers_process_on_error_zero_rescores_the_batch_row_by_row(plugin):
    cfg = RewardConfig(function=plugin, on_error="zero")
    in_process = build_reward_fn(cfg, None)
    reward = Guarded(in_process, cfg, None)
    responses, examples, finished = rows(["abc", "raise", "abcdefg"])
    values = reward(responses, examples, finished)
    assert reward.drain().errors == 1 and reward.drain().errors == 0
    alone = [in_process([responses[i]], [examples[i]], [True])[0] for i in (0, 2)]
    np.testing.assert_array_equal(values, [alone[0], 0.0, alone[1]])
    with pytest.raises(RewardFunctionError, match="raised ValueError: this row is bad on sample 1"):
        Guarded(in_process, RewardConfig(function=plugin), None)(responses, examples, finished)


def test_built_in_scorers_run_in_workers_as_in_the_trainer():
    task = get_task("reverse_digits", {})
    cfg = RewardConfig(kind="task", format_weight=0.5, workers=2)
    examples = task.examples("train", 6, seed=0)
    texts = [e.answer for e in examples[:3]] + ["nope", "", examples[5].answer[::-1] + "0"]
    finished = [True, False, True, True, False, True]
    in_process = build_reward_fn(cfg, task)
    reward = Guarded(in_process, cfg, ("reverse_digits", {}))
    try:
        values = reward(texts, examples, finished)
    finally:
        reward.close()
    expected = in_process(texts, examples, finished)
    assert len(set(expected.tolist())) > 2  # solved with and without the format term, and wrong
    np.testing.assert_array_equal(values, expected)
