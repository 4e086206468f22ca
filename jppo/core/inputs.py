"""Where a run's prompts and rewards come from: the ``data`` and ``reward`` sections' records, declared once.

The trainer's config (:mod:`jppo.config.schema`) composes them and :mod:`jppo.data` and :mod:`jppo.rewards`
re-export them; they live at the bottom so that loading and checking a config loads the config layer and
``jppo.core`` only. Each record checks what needs only its own values when it is built; the names a registry holds
(built-in tasks, reward kinds) are checked by the registry's module (:func:`jppo.core.checks.register_config_check`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Union

# ``builtin:<task>``: one spelling of built-in names, for tokenizers (model.tokenizer) and environments (rollout.env)
BUILTIN_PREFIX = "builtin:"
# data.task: reasoning-gym's generated datasets by name
REASONING_GYM_PREFIX = "reasoning_gym:"
# How reward.function is called (jppo.rewards.adapters): jppo's fn(responses, examples), verl's, TRL's
FUNCTION_STYLES = ("jppo", "verl", "trl")
ON_ERROR = ("raise", "zero")  # reward.on_error
CODE_SCORES = ("fraction", "all")  # reward.code.score
TRUNCATIONS = ("error", "left")
FILES_TASK = "files"
# Variables of the chat template that jppo sets itself (the messages, and the assistant header it always adds).
RESERVED_TEMPLATE_VARIABLES = ("messages", "add_generation_prompt")

Files = Union[str, list, None]  # "a.jsonl", "a.jsonl,b.jsonl" or ["a.jsonl", "b.jsonl"]


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where prompts come from and how they are batched (verl's ``data`` section names where they exist).

    ``seed`` seeds the generated examples of built-in and reasoning-gym tasks (the shuffle seed is the one given
    to :meth:`PromptDataset.batch_at`). ``max_prompt_length`` counts tokens after the chat template; a longer
    prompt is an error at load time, or with ``truncation: left`` loses its first tokens.
    """

    task: str = "reverse_digits"  # a built-in task, "reasoning_gym:<dataset>", or "files" (train_files/val_files)
    train_files: Any = None  # Files: one path, "a.jsonl,b.jsonl", or a list of paths
    val_files: Any = None  # the held-out prompts of task "files", given as train_files is
    prompt_key: str = "prompt"  # a file row's prompt column (dotted for a nested one): a string or chat messages
    answer_key: str = "answer"  # a file row's answer column (dotted, e.g. reward_model.ground_truth)
    train_batch_size: int = 32  # prompts per training step (each sampled rollout.n times)
    val_batch_size: int = 64  # prompts per validation batch
    num_train_examples: int = 20000  # examples a generated task draws for training (not used by "files")
    num_val_examples: int = 256  # held-out examples a generated task draws
    max_prompt_length: int = 32
    truncation: str = "error"  # a prompt over max_prompt_length: "error" at load time, or "left" drops its first tokens
    apply_chat_template: bool = False  # wrap each prompt in the tokenizer's chat template (a string as a user turn)
    apply_chat_template_kwargs: dict = dataclasses.field(default_factory=dict)  # variables of the chat template
    shuffle: bool = True  # a new order of the training prompts every epoch (validation keeps the stored order)
    seed: int = 0
    task_options: dict = dataclasses.field(default_factory=dict)  # the task's own options (reverse_digits: min_len)

    def __post_init__(self) -> None:
        if self.truncation not in TRUNCATIONS:
            raise ValueError(f"data.truncation={self.truncation!r} is invalid: valid values are {list(TRUNCATIONS)}")
        positive = ("train_batch_size", "val_batch_size", "num_train_examples", "num_val_examples", "max_prompt_length")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"data.{name}={value!r} is invalid: it must be an integer >= 1")
        # a built-in task's name is checked against its registry by jppo.data.tasks (check_task_name)
        for key in ("train_files", "val_files"):
            file_list(getattr(self, key), f"data.{key}")
        if self.task == FILES_TASK and not file_list(self.train_files, "data.train_files"):
            raise ValueError(
                "data.task='files' needs data.train_files (a JSONL or Parquet path, or a list of paths)"
            )
        check_template_kwargs(self.apply_chat_template_kwargs, self.apply_chat_template)


def file_list(files: Files, key: str) -> list[str]:
    """The paths of a ``train_files``/``val_files`` value, in order: a string is split at commas, a list is taken
    item by item (each a string); anything else is an error naming ``key``."""
    if files is None:
        return []
    if isinstance(files, str):
        return [path.strip() for path in files.split(",") if path.strip()]
    if isinstance(files, (list, tuple)):
        for item in files:
            if not isinstance(item, str) or not item.strip():
                raise ValueError(f"{key}={list(files)!r} is invalid: every item of the list must be a file path")
        return [item.strip() for item in files]
    raise ValueError(
        f"{key}={files!r} is invalid: give a path, comma-separated paths, or a list of paths (not a "
        f"{type(files).__name__})"
    )


def check_template_kwargs(kwargs: Any, apply_chat_template: bool) -> None:
    """The extra chat-template variables must be a mapping with string keys that jppo does not set itself, and
    only given when the template is applied."""
    key = "data.apply_chat_template_kwargs"
    if not isinstance(kwargs, dict):
        raise ValueError(f"{key}={kwargs!r} is invalid: it must be a mapping of template variables")
    for name in kwargs:
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"{key} has the key {name!r}: template variable names must be identifiers")
        if name in RESERVED_TEMPLATE_VARIABLES:
            raise ValueError(f"{key} sets {name!r}, which jppo sets itself; remove it")
    if kwargs and not apply_chat_template:
        raise ValueError(f"{key}={kwargs!r} needs data.apply_chat_template=true (there is no template to give it)")


@dataclasses.dataclass(frozen=True)
class OverlongBufferConfig:
    """``reward.overlong_buffer``: on with ``enable``; ``len`` is the buffer ``B`` (tokens, 1 <= B < L), and
    ``penalty_factor`` the penalty ``f`` at the length limit."""

    enable: bool = False
    len: int = 0
    penalty_factor: float = 1.0


@dataclasses.dataclass(frozen=True)
class CodeRewardConfig:
    """``reward.code``: how ``reward.kind: code`` runs a response's program against its row's tests, each test in a
    box of its own (jppo.rewards.code, jppo.rewards.sandbox)."""

    score: str = "fraction"  # fraction (of the row's tests passed) | all (1 when every test passes, else 0)
    # deny: the box has a network namespace of its own, nothing reachable (where the kernel cannot make one, the
    # run refuses to start) | allow: the program may reach the network
    network: str = "deny"
    cpu_s: float = 5.0  # CPU seconds of one test's run
    wall_s: float = 10.0  # wall-clock seconds of one test's run, after which the box is killed
    memory_mb: int = 1024  # address space of the program
    file_mb: int = 16  # the largest file it may write; its /tmp holds 4x this
    processes: int = 32  # processes and threads it may start
    output_kb: int = 1024  # stdout and stderr kept, each; more kills the box and fails the test

    def __post_init__(self) -> None:
        if self.score not in CODE_SCORES:
            raise ValueError(f"reward.code.score={self.score!r} is invalid: valid values are {list(CODE_SCORES)}")
        if self.network not in ("deny", "allow"):
            raise ValueError(f"reward.code.network={self.network!r} is invalid: valid values are ['deny', 'allow']")
        for name in ("cpu_s", "wall_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"reward.code.{name}={value!r} is invalid: it must be a positive number of seconds")
        for name, least in (("memory_mb", 16), ("file_mb", 1), ("processes", 1), ("output_kb", 1)):
            if getattr(self, name) < least:
                raise ValueError(f"reward.code.{name}={getattr(self, name)!r} is invalid: it must be >= {least}")


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    """How responses are scored (the ``reward`` section of the trainer's config)."""

    function: Optional[str] = None  # "path/to/file.py:fn" or "package.module:fn", see jppo.rewards.plugin
    # How reward.function is called: jppo's fn(responses, examples), verl's compute_score, or a TRL reward function
    # (see jppo.rewards.adapters).
    function_style: str = "jppo"
    kind: str = "task"  # the scorer without reward.function: task | gsm8k | boxed | math_verify | none
    gsm8k_flexible: bool = False  # gsm8k: the last number of the response instead of the one after "####"
    format_weight: float = 0.0  # weight of the format term added to the score (jppo.rewards.reward_fn); 0: off
    # Spread a built-in task's per-position credit over the response tokens (a dense reward that sums to the
    # score) instead of putting the whole score on the last token. Needs a task with a ``credit`` method.
    token_level: bool = False
    # A reward model: a value-head checkpoint (a directory transformers can load as *ForTokenClassification /
    # *ForSequenceClassification with one label, or a jppo critic export) whose output at the last token of the
    # prompt + response is added to the rule score (reward.kind: none for the model's score alone). It must share
    # the policy's tokenizer.
    model_path: Optional[str] = None
    # DAPO's soft overlong punishment of training rewards (jppo.rewards.overlong); validation is not shaped.
    overlong_buffer: OverlongBufferConfig = dataclasses.field(default_factory=OverlongBufferConfig)
    # Processes of their own that score the responses, one row per call (jppo.rewards.workers): a call that hangs,
    # raises or kills its worker cannot take the run down. 0: the reward is called in the trainer's process.
    workers: int = 0
    timeout_s: Optional[float] = None  # the longest a worker's call may take (needs reward.workers >= 1); None: none
    # What a call that raises, times out or kills its worker scores: raise (stop the run, naming the row, the
    # function and the error) | zero (score 0, counted in reward/errors and reward/timeouts).
    on_error: str = "raise"
    worker_memory_mb: Optional[int] = None  # each worker's address-space limit; a call past it fails (MemoryError)
    code: CodeRewardConfig = dataclasses.field(default_factory=CodeRewardConfig)  # reward.kind: code's box

    def __post_init__(self) -> None:  # reward.kind: against its registry, by jppo.rewards.reward_fn
        if self.function_style not in FUNCTION_STYLES:
            raise ValueError(
                f"reward.function_style={self.function_style!r} is invalid: valid styles are {list(FUNCTION_STYLES)}"
            )
        if self.function_style != "jppo" and self.function is None:
            raise ValueError(
                f"reward.function_style={self.function_style!r} needs reward.function (the function to call)"
            )
        if not math.isfinite(self.format_weight):
            raise ValueError(f"reward.format_weight={self.format_weight!r} is invalid: it must be a finite number")
        if self.on_error not in ON_ERROR:
            raise ValueError(f"reward.on_error={self.on_error!r} is invalid: valid values are {list(ON_ERROR)}")
        if self.workers < 0:
            raise ValueError(f"reward.workers={self.workers!r} is invalid: it must be >= 0 (0: the trainer's process)")
        if self.timeout_s is not None and not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"reward.timeout_s={self.timeout_s!r} is invalid: it must be a positive number of seconds")
        if self.timeout_s is not None and self.workers == 0:
            raise ValueError(
                f"reward.timeout_s={self.timeout_s!r} needs reward.workers >= 1: a call in the trainer's process "
                "cannot be stopped"
            )
        if self.worker_memory_mb is not None and (self.worker_memory_mb < 64 or self.workers == 0):
            raise ValueError(
                f"reward.worker_memory_mb={self.worker_memory_mb!r} is invalid: it must be >= 64 (MiB), with "
                "reward.workers >= 1"
            )
