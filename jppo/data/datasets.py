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
from typing import Any, Iterator, Optional

import numpy as np

from jppo.core.inputs import (
    FILES_TASK,
    DataConfig,
    file_list,
)
from jppo.data.tasks import SPLITS, Example, Task, get_task
from jppo.data.tokenizer import Tokenizer


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
        import pyarrow.parquet  # noqa: PLC0415 (an optional extra: parquet prompt files only)
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
