"""Answer extraction rules, the batch reward function, and reward plug-ins (jppo.rewards)."""

import concurrent.futures
import dataclasses
import json
import logging
import pathlib
import sys

import numpy as np
import pytest

from jppo.data import DataConfig, Example, get_task
from jppo.data.datasets import read_examples, task_of
from jppo.rewards import (
    RewardConfig,
    RewardFunctionError,
    boxed_score,
    build_reward_fn,
    extract_boxed,
    extract_gsm8k_answer,
    gsm8k_score,
    math_equal,
    math_verify_score,
)

# ---------------------------------------------------------------------------------------------------------------
# GSM8K


@pytest.mark.parametrize(
    "text, strict, flexible",
    [
        ("3 + 4 = 7\n#### 7", "7", "7"),
        ("#### 1,234", "1234", "1234"),
        ("####-7", "-7", "-7"),
        ("#### $ 3.50 dollars", "3.50", "3.50"),
        ("#### 12, then #### 15.", "15", "15"),
        ("#### .5", ".5", ".5"),
        ("the answer is 42", None, "42"),
        ("#### forty-two", None, None),
        ("#### x 5", None, "5"),
        ("", None, None),
    ],
)
def test_gsm8k_extraction(text, strict, flexible):
    assert extract_gsm8k_answer(text) == strict
    assert extract_gsm8k_answer(text, flexible=True) == flexible


@pytest.mark.parametrize(
    "response, answer, expected",
    [
        ("so #### 1,000", "... #### 1000", 1.0),
        ("#### 72.0", "#### 72", 1.0),
        ("#### -5", "#### 5", 0.0),
        ("#### 0.25", "#### .25", 1.0),
        ("#### 3.14", "#### 3.15", 0.0),
        ("#### 1000", "1,000", 1.0),  # an answer without "####" is the number itself
        ("I think 18", "#### 18", 0.0),  # strict: no "####", no answer
        ("", "#### 18", 0.0),
    ],
)
def test_gsm8k_score(response, answer, expected):
    assert gsm8k_score(response, answer) == expected


def test_gsm8k_flexible_takes_the_last_number_and_bad_reference_is_an_error():
    assert gsm8k_score("first 3, then 18.", "#### 18", flexible=True) == 1.0
    assert gsm8k_score("18 or maybe 19", "#### 18", flexible=True) == 0.0
    with pytest.raises(ValueError, match="has no final number for reward.kind=gsm8k"):
        gsm8k_score("#### 1", "#### many")


# ---------------------------------------------------------------------------------------------------------------
# Boxed


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so \boxed{42}.", "42"),
        (r"\boxed{\frac{1}{2}} is it", r"\frac{1}{2}"),
        (r"\boxed{1} no, \boxed {2}", "2"),
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),
        (r"\boxed{\frac{1}{2}", None),  # never closes
        ("no box here", None),
        (r"\boxed{}", ""),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    "predicted, reference, equal",
    [
        (r"\dfrac{1}{2}", r"\frac{1}{2}", True),
        ("1,000", "1000", True),
        ("$-3.0$", "-3", True),
        (r"90^\circ", "90", True),
        (r"50\%", "50", True),
        (r"\text{5 cm}", "5cm", True),
        (r"\left( 1, 2 \right)", "(1,2)", True),
        ("x = 2", "x=2.", True),
        ("3", "-3", False),
        (r"\frac{1}{3}", r"\frac{1}{2}", False),
    ],
)
def test_math_equal(predicted, reference, equal):
    assert math_equal(predicted, reference) is equal


def test_boxed_score_uses_the_reference_box_when_present():
    assert boxed_score(r"thus \boxed{\dfrac{3}{4}}", r"we get \boxed{\frac{3}{4}}") == 1.0
    assert boxed_score(r"\boxed{1,024}", "1024") == 1.0
    assert boxed_score("1024", "1024") == 0.0  # no box, no answer
    assert boxed_score(r"\boxed{1023}", "1024") == 0.0


# ---------------------------------------------------------------------------------------------------------------
# math_verify

# Answers the text rule of reward.kind=boxed misses; math-verify compares them as mathematics.
EQUAL_SPELLINGS = [(r"so \boxed{\frac12}", "0.5"), (r"\boxed{x=3}", "3"), (r"\boxed{\sqrt2}", r"\sqrt{2}")]
WRONG_ANSWERS = [(r"\boxed{\frac13}", "0.5"), (r"\boxed{x=4}", "3"), (r"\boxed{\sqrt3}", r"\sqrt{2}"),
                 ("the answer is 3", "3"), (r"\boxed{\frac{1}{", "0.5"), (r"\boxed{)(}", "3")]


def test_math_verify_scores_equal_spellings_that_boxed_misses():
    examples = [Example("q", answer) for _, answer in EQUAL_SPELLINGS]
    responses = [response for response, _ in EQUAL_SPELLINGS]
    boxed = build_reward_fn(RewardConfig(kind="boxed"), None)
    verified = build_reward_fn(RewardConfig(kind="math_verify", format_weight=0.5), None)
    np.testing.assert_array_equal(boxed(responses, examples, [True] * 3), [0.0, 0.0, 0.0])  # unchanged rule
    np.testing.assert_array_equal(verified(responses, examples, [True] * 3), [1.5, 1.5, 1.5])
    assert math_verify_score(r"\boxed{0.5}", r"we get \boxed{\frac{1}{2}}") == 1.0  # the reference's own box


@pytest.mark.parametrize("response, answer", WRONG_ANSWERS)
def test_math_verify_keeps_wrong_or_unparsable_answers_at_zero(response, answer):
    assert math_verify_score(response, answer) == 0.0


def test_math_verify_works_off_the_main_thread():
    """math-verify's timeouts use signal.alarm, which only the main thread may set: elsewhere they are off."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        scores = list(pool.map(lambda pair: math_verify_score(*pair), EQUAL_SPELLINGS + WRONG_ANSWERS[:2]))
    assert scores == [1.0, 1.0, 1.0, 0.0, 0.0]


def test_math_verify_without_the_package_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # as if not installed
    with pytest.raises(ValueError, match=r"reward.kind='math_verify' needs the package math-verify: pip install"):
        build_reward_fn(RewardConfig(kind="math_verify"), None)


# ---------------------------------------------------------------------------------------------------------------
# build_reward_fn


def test_task_reward_with_format_term():
    task = get_task("reverse_digits")
    examples = [Example(prompt="3051=", answer="1503")] * 4
    rewards = build_reward_fn(RewardConfig(format_weight=0.5), task)(
        ["1503", "1503", "15x3", ""], examples, [True, False, True, True]
    )
    assert rewards.dtype == np.float32 and rewards.shape == (4,)
    # exact + format; exact but cut off (no EOS): no format; 3/4 right but not digits-only; empty: nothing.
    np.testing.assert_array_equal(rewards, np.array([1.5, 1.0, 0.75, 0.0], np.float32))
    plain = build_reward_fn(RewardConfig(), task)(["1503", "15"], examples[:2], [True, True])
    # "15" + EOS: two of the four digits in place
    np.testing.assert_array_equal(plain, np.array([1.0, 0.5], np.float32))


def test_gsm8k_and_boxed_kinds_on_file_datasets():
    examples = [Example(prompt="q", answer="work #### 1,200"), Example(prompt="q", answer="#### 7")]
    gsm8k = build_reward_fn(RewardConfig(kind="gsm8k", format_weight=0.1), None)
    rewards = gsm8k(["so #### 1200", "it is 7"], examples, [True, True])
    # float32 of 1 + 0.1 and of 0: exact to float32 rounding.
    np.testing.assert_allclose(rewards, [1.1, 0.0], rtol=1e-7)
    flexible = build_reward_fn(RewardConfig(kind="gsm8k", gsm8k_flexible=True), None)
    np.testing.assert_array_equal(flexible(["so #### 1200", "it is 7"], examples, [True, True]), [1.0, 1.0])
    boxed = build_reward_fn(RewardConfig(kind="boxed", format_weight=1.0), None)
    rewards = boxed([r"\boxed{7}", r"\boxed{8}"], [Example("q", "7")] * 2, [True, True])
    np.testing.assert_array_equal(rewards, [2.0, 1.0])


def test_reasoning_gym_task_reward():
    task = task_of(DataConfig(task="reasoning_gym:basic_arithmetic", task_options={"min_terms": 2, "max_terms": 2}))
    example = task.examples("train", 1, seed=0)[0]
    reward_fn = build_reward_fn(RewardConfig(format_weight=1.0), task)
    responses = [f"<answer>{example.answer}</answer>", "<answer>none</answer>", example.answer]
    np.testing.assert_array_equal(reward_fn(responses, [example] * 3, [True] * 3), [2.0, 1.0, 0.0])


def test_reward_config_and_build_errors():
    with pytest.raises(ValueError, match=r"reward.kind='math' is invalid: valid kinds are \['task', 'gsm8k', 'boxed"):
        build_reward_fn(RewardConfig(kind="math"), None)  # the kind's name: checked with the config and at use
    with pytest.raises(ValueError, match="reward.format_weight=nan is invalid"):
        RewardConfig(format_weight=float("nan"))
    with pytest.raises(ValueError, match="reward.kind='task' needs a built-in or reasoning-gym data.task"):
        build_reward_fn(RewardConfig(), None)
    reward_fn = build_reward_fn(RewardConfig(), get_task("reverse_digits"))
    with pytest.raises(ValueError, match="2 responses, 1 examples and 2 finished flags"):
        reward_fn(["1", "2"], [Example("1=", "1")], [True, True])


def test_scorer_failure_names_the_sample():
    reward_fn = build_reward_fn(RewardConfig(kind="gsm8k"), None)
    examples = [Example("q", "#### 1"), Example("q", "#### no number", meta={"location": "f.jsonl line 9"})]
    with pytest.raises(RewardFunctionError, match=r"reward.kind=gsm8k failed on sample 1 \(f.jsonl line 9\): Value"):
        reward_fn(["#### 1", "#### 1"], examples, [True, True])


# ---------------------------------------------------------------------------------------------------------------
# Plug-ins

PLUGIN = '''
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class Weights:  # a dataclass with string annotations needs its module registered
    hit: float = 1.0


def length_reward(responses, examples):
    return [len(r) / 10 for r in responses]


def with_finished(responses, examples, finished):
    return np.array([float(f) for f in finished])


def fails_on_x(responses, examples):
    return [1.0 / (r != "x") for r in responses]


def fails_on_batches(responses, examples):
    if len(responses) > 1:
        raise RuntimeError("batch too big")
    return [0.0]


def wrong_length(responses, examples):
    return [1.0]


def strings(responses, examples):
    return ["high"] * len(responses)


def scalar(responses, examples):
    return 1.0


def not_finite(responses, examples):
    return [0.0, float("inf")]


not_a_function = 3
'''


@pytest.fixture(scope="module")
def plugin_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("plugins") / "my_rewards.py"
    path.write_text(PLUGIN)
    return str(path)


EXAMPLES = [Example("p", "a"), Example("p", "b")]


def test_plugin_success_and_finished_flag(plugin_file):
    path_before = list(sys.path)
    reward_fn = build_reward_fn(RewardConfig(function=f"{plugin_file}:length_reward", kind="gsm8k"), None)
    rewards = reward_fn(["abc", "abcdefghij"], EXAMPLES, [True, False])
    np.testing.assert_allclose(rewards, [0.3, 1.0], rtol=1e-7)  # float32 of 0.3
    assert rewards.dtype == np.float32 and sys.path == path_before
    with_finished = build_reward_fn(RewardConfig(function=f"{plugin_file}:with_finished"), None)
    np.testing.assert_array_equal(with_finished(["a", "b"], EXAMPLES, [False, True]), [0.0, 1.0])


def test_plugin_with_format_term_uses_the_kind_rule(plugin_file):
    cfg = RewardConfig(function=f"{plugin_file}:with_finished", kind="boxed", format_weight=2.0)
    rewards = build_reward_fn(cfg, None)([r"\boxed{1}", "1"], EXAMPLES, [True, True])
    np.testing.assert_array_equal(rewards, [3.0, 1.0])
    with pytest.raises(ValueError, match="reward.kind='task' needs"):
        build_reward_fn(RewardConfig(function=f"{plugin_file}:with_finished", format_weight=1.0), None)


@pytest.mark.parametrize(
    "function, responses, message",
    [
        ("fails_on_x", ["a", "b", "x"],
         r"my_rewards.py:fails_on_x raised ZeroDivisionError: .* on sample 2 \(response 'x'\)"),
        ("fails_on_batches", ["a", "b"],
         "raised RuntimeError: batch too big on a batch of 2, though each sample alone"),
        ("wrong_length", ["a", "b"], "returned 1 rewards for 2 responses"),
        ("strings", ["a", "b"], r"returned list \"\['high', 'high'\]\"; it must return a list or 1-D array of floats"),
        ("scalar", ["a", "b"], "returned float '1.0'; it must return a list or 1-D array"),
        ("not_finite", ["a", "b"], "returned the non-finite reward inf for sample 1"),
    ],
)
def test_plugin_call_errors_name_the_function(plugin_file, function, responses, message):
    reward_fn = build_reward_fn(RewardConfig(function=f"{plugin_file}:{function}"), None)
    with pytest.raises(RewardFunctionError, match=message) as error:
        reward_fn(responses, [Example("p", "a")] * len(responses), [True] * len(responses))
    assert "\n" not in str(error.value)


def test_plugin_load_errors(plugin_file, tmp_path):
    with pytest.raises(ValueError, match=r"reward.function='/no/such.py:fn': file '/no/such.py' does not exist"):
        build_reward_fn(RewardConfig(function="/no/such.py:fn"), None)
    with pytest.raises(ValueError,
                       match=r"reward.function='rewards.py' is invalid: expected 'path/to/file.py:function"):
        build_reward_fn(RewardConfig(function="rewards.py"), None)
    with pytest.raises(ValueError,
                       match=r"'missing' does not exist in .*; its functions: \['fails_on_batches', 'fails_on_x'"):
        build_reward_fn(RewardConfig(function=f"{plugin_file}:missing"), None)
    with pytest.raises(ValueError, match="'not_a_function' is not callable"):
        build_reward_fn(RewardConfig(function=f"{plugin_file}:not_a_function"), None)
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_module_anywhere\n")
    with pytest.raises(ValueError, match=r"broken.py' raised ModuleNotFoundError: No module named 'no_such_module_any"):
        build_reward_fn(RewardConfig(function=f"{broken}:fn"), None)
    assert not any(name.startswith("jppo_reward_plugin_broken") for name in sys.modules)


# ---------------------------------------------------------------------------------------------------------------
# Functions written for verl and TRL (reward.function_style)

FOREIGN = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    score = float(solution_str.strip() == ground_truth) + extra_info.get("bonus", 0.0)
    return {"score": score, "acc": score >= 1} if data_source == "dict" else score


def verl_no_score(data_source, solution_str, ground_truth, extra_info):
    return {"acc": 1.0}


def verl_text(data_source, solution_str, ground_truth, extra_info):
    return "high"


def verl_two_arguments(solution, answer):
    return 0.0


def trl_reward(completions, prompts, ground_truth, difficulty, **kwargs):
    assert sorted(kwargs) == ["data_source", "extra_info"], sorted(kwargs)
    return [None if d is None else float(c == g) * d + len(p) / 100
            for c, p, g, d in zip(completions, prompts, ground_truth, difficulty)]


def trl_short(completions, **kwargs):
    return [1.0]


def trl_strings(completions, **kwargs):
    return ["high"] * len(completions)


def trl_scalar(completions, **kwargs):
    return 1.0


def trl_no_kwargs(completions):
    return [0.0] * len(completions)
'''

ROWS = [
    {"prompt": "2+2=", "answer": "4", "difficulty": 2, "data_source": "arith"},
    {"prompt": "3+3=", "answer": "6", "difficulty": None, "data_source": "arith"},
    {"prompt": "1+1=", "answer": "2", "data_source": "dict", "extra_info": {"bonus": 0.5}},
]


@pytest.fixture(scope="module")
def foreign(tmp_path_factory):
    """The reward file's path, and the examples of ROWS read from a JSONL file as a user's data would be."""
    directory = tmp_path_factory.mktemp("foreign")
    (directory / "scores.py").write_text(FOREIGN)
    (directory / "rows.jsonl").write_text("\n".join(json.dumps(row) for row in ROWS) + "\n")
    cfg = DataConfig(task="files", train_files=str(directory / "rows.jsonl"))
    return str(directory / "scores.py"), read_examples(str(directory / "rows.jsonl"), cfg, "data.train_files")


def foreign_reward(foreign, name, style):
    return build_reward_fn(RewardConfig(function=f"{foreign[0]}:{name}", function_style=style, kind="none"), None)


def test_verl_compute_score_returning_numbers_and_dicts(foreign):
    reward_fn = foreign_reward(foreign, "compute_score", "verl")
    rewards = reward_fn(["4", "5", " 2"], foreign[1], [True, True, False])
    np.testing.assert_array_equal(rewards, np.array([1.0, 0.0, 1.5], np.float32))  # the dict's "score" for row 3


def test_verl_function_from_an_installed_module(foreign, monkeypatch):
    monkeypatch.syspath_prepend(str(pathlib.Path(foreign[0]).parent))
    cfg = RewardConfig(function="scores:compute_score", function_style="verl", kind="none")
    np.testing.assert_array_equal(build_reward_fn(cfg, None)(["4"], foreign[1][:1], [True]), [1.0])
    with pytest.raises(ValueError, match="'no_such_module' is neither a file nor an importable module"):
        build_reward_fn(dataclasses.replace(cfg, function="no_such_module:fn"), None)


def test_trl_function_receives_the_columns_and_none_scores_zero(foreign, caplog):
    reward_fn = foreign_reward(foreign, "trl_reward", "trl")
    with caplog.at_level(logging.WARNING):
        rewards = reward_fn(["4", "6", "2"], foreign[1], [True] * 3)
    np.testing.assert_allclose(rewards, [2.04, 0.0, 0.0], rtol=1e-7)  # rows 2 and 3 have no difficulty: None
    assert "trl_reward gave no reward (None) to 2 of 3 responses; they score 0" in caplog.text


@pytest.mark.parametrize(
    "name, style, message",
    [
        ("verl_no_score", "verl", r"verl_no_score returned a dict without a number under 'score' \(\['acc'\]\)"),
        ("verl_text", "verl", "verl_text returned str 'high' for sample 0; a verl compute_score returns a number"),
        ("trl_short", "trl", "trl_short returned 1 rewards for 3 completions"),
        ("trl_strings", "trl", "trl_strings returned str 'high' for sample 0; each reward must be a float or None"),
        ("trl_scalar", "trl", "trl_scalar returned float '1.0'; a TRL reward function returns a list"),
    ],
)
def test_foreign_functions_returning_the_wrong_thing_are_named(foreign, name, style, message):
    reward_fn = foreign_reward(foreign, name, style)
    with pytest.raises(RewardFunctionError, match=message) as error:
        reward_fn(["4", "6", "2"], foreign[1], [True] * 3)
    assert "\n" not in str(error.value) and f"scores.py:{name}" in str(error.value)


def test_foreign_function_styles_are_checked_when_loaded(foreign):
    with pytest.raises(ValueError, match=r"verl_two_arguments' with reward.function_style='verl' must take the keyw"):
        foreign_reward(foreign, "verl_two_arguments", "verl")
    with pytest.raises(ValueError, match=r"trl_no_kwargs' with reward.function_style='trl' must take \(completions"):
        foreign_reward(foreign, "trl_no_kwargs", "trl")
    with pytest.raises(ValueError, match=r"reward.function_style='openrlhf' is invalid: valid styles are \['jppo'"):
        RewardConfig(function=f"{foreign[0]}:compute_score", function_style="openrlhf")
    with pytest.raises(ValueError, match="reward.function_style='trl' needs reward.function"):
        RewardConfig(function_style="trl")
