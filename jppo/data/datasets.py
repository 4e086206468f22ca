"""Prompt datasets: examples of one split, tokenized once, served in batches that a single integer can resume.

``PromptDataset.batch_at(position, batch_size, seed)`` is a pure function of its arguments. ``position`` counts
the prompts consumed so far over all epochs; prompt ``k`` of the stream is example ``order_e[k mod L]`` with
``e = k // L`` the epoch and ``order_e`` a permutation drawn from ``(seed, e)`` (the identity when not shuffling).
A batch may run across an epoch boundary, so every batch is full and nothing is dropped. The trainer saves one
integer, the next position, and resumes exactly.

Sources (``DataConfig.task``): a built-in task or ``reasoning_gym:<dataset>`` (generated, ``num_*_examples``
per split), or ``"files"``: JSONL or Parquet rows with a prompt (a string, or a list of chat messages as in
verl's Parquet files) and an answer. Keys may be dotted to reach into nested columns, e.g.
``answer_key: reward_model.ground_truth`` for verl-prepared data. ``train_files``/``val_files`` name one file, a
comma-separated string of files, or a YAML list of files; the files' rows are concatenated in the order given.

With ``apply_chat_template``, ``apply_chat_template_kwargs`` are extra variables for the template (as
``tokenizer.apply_chat_template(..., **kwargs)`` passes them), e.g. ``{enable_thinking: false}`` for Qwen3.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, Iterator, Optional, Union

import numpy as np

from jppo.data.tasks import BUILTIN_TASKS, REASONING_GYM_PREFIX, SPLITS, Example, Task, get_task
from jppo.data.tokenizer import Tokenizer

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
        known = self.task in (FILES_TASK, *BUILTIN_TASKS) or self.task.startswith(REASONING_GYM_PREFIX)
        if not known:
            raise ValueError(
                f"data.task={self.task!r} is unknown; valid tasks: {sorted(BUILTIN_TASKS)}, "
                f"'{REASONING_GYM_PREFIX}<dataset>', '{FILES_TASK}'"
            )
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


def task_of(cfg: DataConfig) -> Optional[Task]:
    """The task that generates and scores the prompts; ``None`` for ``task: files`` (rewards then come from
    ``reward.kind`` or a plug-in)."""
    return None if cfg.task == FILES_TASK else get_task(cfg.task, dict(cfg.task_options))


@dataclasses.dataclass(frozen=True)
class PromptDataset:
    """The examples of one split and their prompt tokens (``prompt_ids[i]`` belongs to ``examples[i]``)."""

    examples: list[Example]
    prompt_ids: list[list[int]]
    shuffle: bool

    def __post_init__(self) -> None:
        if not self.examples:
            raise ValueError("a prompt dataset needs at least one example")

    def __len__(self) -> int:
        return len(self.examples)

    def _order(self, seed: int, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self))
        return np.random.default_rng([seed, epoch]).permutation(len(self))

    def batch_at(self, position: int, batch_size: int, seed: int) -> tuple[list[Example], list[list[int]], int]:
        """The ``batch_size`` prompts after the first ``position`` ones: ``(examples, prompt_ids, next_position)``."""
        if position < 0 or batch_size < 1:
            raise ValueError(
                f"batch_at(position={position}, batch_size={batch_size}): need position >= 0, batch_size >= 1"
            )
        size = len(self)
        indices = []
        for epoch in range(position // size, (position + batch_size - 1) // size + 1):
            order = self._order(seed, epoch)
            start, stop = max(position, epoch * size), min(position + batch_size, (epoch + 1) * size)
            indices.extend(order[start - epoch * size : stop - epoch * size].tolist())
        return [self.examples[i] for i in indices], [self.prompt_ids[i] for i in indices], position + batch_size

    def batches(self, batch_size: int) -> Iterator[tuple[list[Example], list[list[int]]]]:
        """One pass in stored order (validation), each example once; the last batch may be smaller."""
        for start in range(0, len(self), batch_size):
            yield self.examples[start : start + batch_size], self.prompt_ids[start : start + batch_size]


def load_dataset(cfg: DataConfig, tokenizer: Tokenizer, split: str) -> PromptDataset:
    """The ``split`` ("train" or "val") of the configured source, tokenized; validation is never shuffled."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is invalid: valid splits are {list(SPLITS)}")
    if cfg.task == FILES_TASK:
        key = f"data.{split}_files"
        paths = cfg.train_files if split == "train" else cfg.val_files
        if not file_list(paths, key):
            raise ValueError(f"{key} is not set: give a JSONL or Parquet path (or a list of paths)")
        examples = [example for path in file_list(paths, key) for example in read_examples(path, cfg, key)]
        if not examples:
            raise ValueError(f"{key}={paths!r} holds no rows")
    else:
        count = cfg.num_train_examples if split == "train" else cfg.num_val_examples
        examples = task_of(cfg).examples(split, count, cfg.seed)
    prompt_ids = [_prompt_tokens(example, index, cfg, tokenizer) for index, example in enumerate(examples)]
    return PromptDataset(examples=examples, prompt_ids=prompt_ids, shuffle=cfg.shuffle and split == "train")


def _prompt_tokens(example: Example, index: int, cfg: DataConfig, tokenizer: Tokenizer) -> list[int]:
    where = example.meta.get("location", f"generated example {index}")
    if cfg.apply_chat_template:
        messages = example.messages or [{"role": "user", "content": example.prompt}]
        text = tokenizer.apply_chat_template(messages, **cfg.apply_chat_template_kwargs)
        ids = tokenizer.encode(text, add_special_tokens=False)
    elif example.messages is not None:
        raise ValueError(f"{where} has chat messages as its prompt: set data.apply_chat_template=true")
    else:
        ids = tokenizer.encode(example.prompt, add_special_tokens=True)
    if len(ids) > cfg.max_prompt_length:
        if cfg.truncation == "error":
            raise ValueError(
                f"prompt of {where} has {len(ids)} tokens > data.max_prompt_length={cfg.max_prompt_length} "
                f"({example.prompt[:60]!r}...): raise the limit or set data.truncation=left"
            )
        ids = ids[len(ids) - cfg.max_prompt_length :]
    return ids


def read_examples(path: str, cfg: DataConfig, config_key: str) -> list[Example]:
    """The examples of one JSONL or Parquet file; ``config_key`` names the setting that gave the path in errors."""
    where = "row" if path.endswith(".parquet") else "line"
    return [_row_to_example(row, f"{path} {where} {number}", cfg) for number, row in read_rows(path, config_key)]


def read_rows(path: str, config_key: str) -> list[tuple[int, dict]]:
    """``(number, row)`` pairs of a JSONL file (number = line) or a Parquet file (number = row, from 1)."""
    file = pathlib.Path(path)
    if not file.is_file():
        raise ValueError(f"{config_key}: file {path!r} does not exist")
    if file.suffix == ".parquet":
        return _parquet_rows(file)
    if file.suffix == ".jsonl":
        return _jsonl_rows(file)
    raise ValueError(f"{config_key}: file {path!r} has suffix {file.suffix!r}; valid suffixes: .jsonl, .parquet")


def _jsonl_rows(file: pathlib.Path) -> list[tuple[int, dict]]:
    rows = []
    with file.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{file} line {number} is not valid JSON: {error}") from None
            if not isinstance(row, dict):
                raise ValueError(f"{file} line {number} is a JSON {type(row).__name__}, not an object")
            rows.append((number, row))
    return rows


def _parquet_rows(file: pathlib.Path) -> list[tuple[int, dict]]:
    try:
        import pyarrow.parquet
    except ImportError:
        raise ValueError(
            f"reading {file} needs pyarrow: pip install pyarrow (or pip install 'jppo[parquet]')"
        ) from None
    return list(enumerate(pyarrow.parquet.read_table(file).to_pylist(), start=1))


def _lookup(row: dict, dotted_key: str) -> Any:
    value: Any = row
    for part in dotted_key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(dotted_key)
        value = value[part]
    return value


def _row_to_example(row: dict, where: str, cfg: DataConfig) -> Example:
    values = {}
    for setting, key in (("prompt_key", cfg.prompt_key), ("answer_key", cfg.answer_key)):
        try:
            values[setting] = _lookup(row, key)
        except KeyError:
            raise KeyError(f"{where} has no key {key!r} (data.{setting}); its keys are {sorted(row)}") from None
    prompt, answer = values["prompt_key"], values["answer_key"]
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(answer, str):
        raise ValueError(
            f"{where}: answer {cfg.answer_key!r} is a {type(answer).__name__}; it must be a string or number"
        )
    messages = None
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
            raise ValueError(
                f"{where}: prompt {cfg.prompt_key!r} must be a string or a list of {{role, content}} messages"
            )
        messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
        prompt = next((m["content"] for m in reversed(messages) if m["role"] == "user"), messages[-1]["content"])
    elif not isinstance(prompt, str):
        raise ValueError(
            f"{where}: prompt {cfg.prompt_key!r} is a {type(prompt).__name__}; it must be a string or messages"
        )
    # A dotted key reads inside a column that may hold more (verl's reward_model, extra_info): keep that column.
    consumed = {key for key in (cfg.prompt_key, cfg.answer_key) if "." not in key}
    meta = {key: value for key, value in row.items() if key not in consumed}
    meta["location"] = where
    return Example(prompt=prompt, answer=answer, meta=meta, messages=messages)
