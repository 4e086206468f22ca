"""Every option does what it says or is refused in one line: a property-based fuzz of the whole config schema.

Keys are drawn from every leaf of :class:`~jppo.config.TrainConfig` (``dataclasses.fields``, recursively), one to
three per example, with odd values of every type (``""``, ``"abc"``, ``"nan"``, ``"[1,2]"``, ``-1``, ``1e9``, the
registries' names, ...), and given as ``key=value`` overrides to every shipped config. Two properties:

1. validation (:func:`load_config`, :func:`check_mesh` and :func:`build.load_inputs`, what the CLI runs before
   anything compiles; for the SFT config, what ``python -m jppo.sft`` runs) either accepts or raises
   :class:`ConfigError` whose one-line message names a drawn key (or, for a conflict with a value of the config file,
   the key it conflicts with);
2. a config that validation accepts trains a step (a tiny model on one device) without an exception.

CI runs a fixed (derandomized) sample within a minute; ``JPPO_FUZZ_EXAMPLES=N`` runs N random examples per test
instead. The 0.5B configs name a checkpoint and GSM8K files that CI does not have: they are fuzzed with those
paths swapped for the built-in task, everything else as shipped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import pathlib
import tempfile
import typing

import jax
from hypothesis import HealthCheck, example, given, reject, settings
from hypothesis import strategies as st

from jppo.advantages import ADVANTAGE_ESTIMATORS
from jppo.config import ConfigError, TrainConfig, check_mesh, load_config
from jppo.data import BUILTIN_TASKS
from jppo.losses import AGG_MODES, KL_KINDS, POLICY_LOSSES
from jppo.models.config import DTYPES
from jppo.models.families import MODEL_FAMILIES
from jppo.rewards import REWARD_KINDS
from jppo.run import build, sft
from jppo.run.loop import run

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
# What the real-size GSM8K configs need from outside (a checkpoint, GSM8K files), replaced by the built-in task.
LOCAL_STAND_IN = [
    "model.path=null", "data.task=reverse_digits", "data.train_files=null", "data.val_files=null",
    "data.apply_chat_template=false", "reward.kind=task",
]
# One step of a tiny model on one device, with validation data at hand (val_every=0 leaves it unused).
TINY = [
    "data.train_batch_size=4", "actor.ppo_mini_batch_size=2", "critic.ppo_mini_batch_size=2",
    "actor.ppo_micro_batch_size=1", "critic.ppo_micro_batch_size=1", "actor.ppo_epochs=1", "critic.ppo_epochs=1",
    "actor.ppo_max_token_len=64", "critic.ppo_max_token_len=64", "data.num_train_examples=64",
    "data.num_val_examples=4", "data.val_batch_size=4", "model.hidden_size=16", "model.intermediate_size=32",
    "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=null", "rollout.n=2",
    "rollout.max_response_length=4", "rollout.prompt_bucket=8", "trainer.total_steps=1", "trainer.save_every=0",
    "trainer.val_every=0", "trainer.plots=false", "trainer.logger=[console,jsonl]", "trainer.progress_bar=false",
    "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", "mesh.expert=1",
]
# The same for python -m jppo.sft's config: its own batch, one micro-batch, rows of the quickstart task
TINY_SFT = [
    "sft.batch_size=4", "actor.ppo_micro_batch_size=2", "data.num_train_examples=64", "data.num_val_examples=4",
    "data.val_batch_size=4", "model.hidden_size=16", "model.intermediate_size=32", "model.num_layers=1",
    "model.num_heads=2", "model.num_kv_heads=null", "rollout.max_response_length=4", "trainer.total_steps=1",
    "trainer.save_every=0", "trainer.val_every=0", "trainer.val_before_train=false", "trainer.plots=false",
    "trainer.export_hf=false", "trainer.logger=[console,jsonl]", "trainer.progress_bar=false", "mesh.data=1",
]
# Generating a billion prompts is a matter of memory and patience, not of validation: such samples skip
# load_inputs (their config and mesh checks still run).
MAX_GENERATED_EXAMPLES = 100_000


def schema(cls: type = TrainConfig, prefix: str = "") -> dict[str, type]:
    """``{dotted key: type}`` of every leaf of the config tree (``Optional[X]`` as ``X``)."""
    hints = typing.get_type_hints(cls)
    leaves: dict[str, type] = {}
    for field in dataclasses.fields(cls):
        kind = hints[field.name]
        if dataclasses.is_dataclass(kind):
            leaves.update(schema(kind, f"{prefix}{field.name}."))
            continue
        args = [arg for arg in typing.get_args(kind) if arg is not type(None)]
        leaves[f"{prefix}{field.name}"] = args[0] if typing.get_origin(kind) is typing.Union else kind
    return leaves


SCHEMA = schema()
ODD = ["", "abc", "nan", "inf", "-inf", "-1", "0", "1", "2", "1e9", "[1,2]", "true", "false", "null", "0.5", "{a: 1}",
       "{a: 1", "[1,", '"x', "${oops}"]
# Valid names of every registry, offered to every string key: a name valid for one key is odd for another.
NAMES = sorted({
    *POLICY_LOSSES, *ADVANTAGE_ESTIMATORS, *AGG_MODES, *KL_KINDS, *REWARD_KINDS, *BUILTIN_TASKS, *DTYPES,
    *MODEL_FAMILIES, "global", "per_micro_batch", "adamw", "sgd", "constant", "cosine", "fixed", "adaptive",
    "auto", "never", "files", "error", "left", "builtin:reverse_digits", "builtin:abc", "reasoning_gym:abc", ".",
})
LIST_ELEMENTS = ["a", "", "nan", "1.5", "null", "[1]", "{a: 1}", "console", "q_proj"]
TASK_OPTIONS = ["{}", "{min_len: 1, max_len: 2}", "{min_len: 4, max_len: 3}", "{max_len: 40}", "{max_operand: 0}",
                "{x: 1}"]


def _number(value: float) -> str:
    return repr(value) if math.isfinite(value) else str(value)


def typed_values(kind: type, small: bool) -> st.SearchStrategy[str]:
    """Odd values of the key's own type; ``small`` keeps sizes within a tiny training step."""
    if kind is bool:
        return st.sampled_from(["true", "false", "True", "no"])
    if kind is int:
        extra = [8] if small else [64, 10**9, 2**63]
        return st.one_of(st.integers(-2, 9), st.sampled_from(extra)).map(str)
    if kind is float:
        odd = [0.0, -0.0, 1.0, -1.0, 0.5, 1.5, 3.0, 1e-9, 1e9, math.nan, math.inf, -math.inf]
        return st.one_of(st.sampled_from(odd), st.floats(-10, 10)).map(_number)
    if kind is dict:
        return st.sampled_from(TASK_OPTIONS)
    if typing.get_origin(kind) in (list, tuple):  # lists of odd elements: an element's refusal names the key too
        element = st.one_of(st.sampled_from(LIST_ELEMENTS), st.integers(-2, 9).map(str), st.sampled_from(NAMES))
        return st.lists(element, max_size=3).map(lambda items: "[" + ",".join(items) + "]")
    return st.sampled_from(NAMES)


@st.composite
def overrides(draw, small: bool = False) -> list[str]:
    """One to three distinct keys of the schema, each with an odd value (generic or of its type)."""
    keys = draw(st.lists(st.sampled_from(sorted(SCHEMA)), min_size=1, max_size=3, unique=True))
    return [f"{key}={draw(st.one_of(st.sampled_from(ODD), typed_values(SCHEMA[key], small)))}" for key in keys]


def base_overrides(config: pathlib.Path) -> list[str]:
    return LOCAL_STAND_IN if "gsm8k" in config.name else []


def is_sft(config: pathlib.Path) -> bool:
    return config.name == "quickstart_sft.yaml"


def validate_like_the_cli(config: pathlib.Path, items: list[str]):
    """What ``jppo.train.main`` (``jppo.sft.main`` for the SFT config) runs before anything compiles, on one
    device."""
    if is_sft(config):
        cfg = load_config(config, items, sft=True)
        shape = sft.mesh_shape(cfg, 1)
        if cfg.data.num_train_examples + cfg.data.num_val_examples > MAX_GENERATED_EXAMPLES:
            return cfg, shape, None
        return cfg, shape, sft.load_inputs(cfg)
    cfg = load_config(config, items, sft=False)
    shape = check_mesh(cfg, 1)
    if cfg.data.num_train_examples + cfg.data.num_val_examples > MAX_GENERATED_EXAMPLES:
        return cfg, shape, None
    return cfg, shape, build.load_inputs(cfg)


def assert_refused_in_one_line(error: BaseException, drawn: list[str]) -> None:
    """The refusal is a :class:`ConfigError` whose message names a drawn key, or (a conflict with the config file)
    at least the key it conflicts with."""
    assert isinstance(error, ConfigError), f"{type(error).__name__}: {error}"
    message = str(error)
    assert message.strip() and "\n" not in message, message
    keys = [item.split("=", 1)[0] for item in drawn]
    assert any(key in message for key in keys) or any(key in message for key in SCHEMA), message


def fuzz_settings(examples: int) -> settings:
    deep = int(os.environ.get("JPPO_FUZZ_EXAMPLES", "0"))
    return settings(
        max_examples=deep or examples, derandomize=not deep, database=None, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
    )


@fuzz_settings(examples=200)
@given(config=st.sampled_from(CONFIGS), drawn=overrides())
@example(config=QUICKSTART, drawn=["model.mlp_only_layers=[a]"])  # once refused without its key or value
@example(config=QUICKSTART, drawn=["actor.lora.target_modules=[[1]]"])  # once a TypeError (a list is unhashable)
def test_validation_accepts_or_refuses_in_one_line_naming_the_key(config, drawn):
    try:
        validate_like_the_cli(config, base_overrides(config) + drawn)
    except Exception as error:  # noqa: BLE001 (the property is about which exceptions)
        assert_refused_in_one_line(error, drawn)


@contextlib.contextmanager
def inside(directory: str):
    """Relative paths of the sample (output_dir, resume) resolve in a scratch directory, never in the repository."""
    previous = os.getcwd()
    os.chdir(directory)
    try:
        yield
    finally:
        os.chdir(previous)


# The crashes issue 17 reported (each a traceback after start-up), pinned: they run first, in every CI run.
ISSUE_17 = [["trainer.val_before_train=true"], ["actor.clip_ratio_c=0.5"], ["rollout.val_n=0"], ["rollout.val_n=-1"]]


def pinned(examples: list[list[str]]):
    """Each of ``examples`` as an explicit example on the quickstart config, in the order given."""

    def add(test):
        for drawn in reversed(examples):
            test = example(config=QUICKSTART, drawn=drawn)(test)
        return test

    return add


@fuzz_settings(examples=2)  # samples that train; refused ones are checked, then drawn again
@given(config=st.sampled_from(CONFIGS), drawn=overrides(small=True))
@pinned(ISSUE_17)
def test_an_accepted_config_trains_a_step(config, drawn):
    with tempfile.TemporaryDirectory() as scratch, inside(scratch):
        try:
            tiny = TINY_SFT if is_sft(config) else TINY
            cfg, shape, inputs = validate_like_the_cli(config, base_overrides(config) + tiny + drawn)
        except Exception as error:  # noqa: BLE001
            assert_refused_in_one_line(error, drawn)
            reject()
        assert inputs is not None  # small sizes only
        (sft.run if is_sft(config) else run)(cfg, shape, inputs, devices=jax.devices()[:1])
