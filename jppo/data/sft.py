"""Supervised fine-tuning's rows: demonstrations read from files (or made from a built-in task), tokenized, with
the loss mask on the tokens the model must learn to produce.

A row is a prompt/completion pair (the prompt tokenized as the trainer tokenizes prompts; the loss on the
completion and the EOS after it) or a chat, a list of ``{role, content}`` messages rendered with the tokenizer's
chat template (the loss on every assistant turn, the template's end-of-turn tokens included). A chat is rendered
turn by turn: the text before assistant turn ``i`` is the template of the messages before it with the generation
prompt, the turn's own text what the template of the messages up to it adds to that. The pieces are tokenized one
by one, so a loss token never straddles a turn's boundary.

A row then becomes one :class:`~jppo.core.experience.Experience` sequence: the prompt is every token before the
first loss token, the response the rest, ``response_mask`` the loss tokens (a chat's user turns after the first
assistant turn are holes in it, as an environment's observations are in a multi-turn rollout). So the update
engine, its micro-batching and its normalizers are the RL update's own.

Whatever a user's data can get wrong (a row without the named keys, an empty assistant turn, a tokenizer without a
chat template, a row longer than the budget) is a ``ValueError`` of one line naming the file, the row and the key,
raised while the rows are read: before anything compiles.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Sequence

import numpy as np

from jppo.core.experience import Experience
from jppo.core.inputs import file_list
from jppo.data.datasets import _lookup, read_rows, task_of
from jppo.data.tokenizer import Tokenizer

ASSISTANT = "assistant"


@dataclasses.dataclass(frozen=True)
class SFTRow:
    """One tokenized demonstration: ``prompt`` (the tokens before the first loss token), ``response`` (the rest)
    and ``mask`` (which response tokens the loss counts)."""

    prompt: tuple[int, ...]
    response: tuple[int, ...]
    mask: tuple[bool, ...]


@dataclasses.dataclass(frozen=True)
class SFTData:
    """The rows of one split, and the padded widths every batch of them takes (the longest row, so a run compiles
    its update once)."""

    rows: list[SFTRow]
    pad_id: int

    def __post_init__(self) -> None:
        if not self.rows:
            raise ValueError("an SFT split needs at least one row")

    def __len__(self) -> int:
        return len(self.rows)

    @functools.cached_property
    def widths(self) -> tuple[int, int]:
        """``(1, W - 1)``, ``W`` the longest row's tokens: a batch lays each row out whole, its first token as the
        prompt and the rest as the response (the prompt's other tokens carry no loss). The longest prompt and the
        longest response, of different rows, would make rows up to twice ``sft.max_length`` wide."""
        return 1, max(len(r.prompt) + len(r.response) for r in self.rows) - 1

    def rows_at(self, position: int, count: int, seed: int) -> np.ndarray:
        """The indices of the ``count`` rows after the first ``position`` of the training order: one permutation
        per epoch, a function of ``(seed, epoch)`` alone (a resumed run reads on from its position)."""
        size, orders = len(self), {}
        out = []
        for at in range(position, position + count):
            epoch, offset = divmod(at, size)
            if epoch not in orders:
                orders[epoch] = np.random.default_rng([seed, epoch]).permutation(size)
            out.append(int(orders[epoch][offset]))
        return np.asarray(out, np.int64)

    def experience(self, indices: Sequence[int], pad_rows: int = 0) -> Experience:
        """The rows ``indices`` as a batch of whole sequences, right-padded to :attr:`widths` (each row's first
        token in the one-token prompt, the rest in the response, the loss on the completion's tokens), then
        ``pad_rows`` empty rows (one padding prompt token, no loss token)."""
        _, length = self.widths
        n = len(indices) + pad_rows
        prompt_ids = np.full((n, 1), self.pad_id, np.int32)
        prompt_mask = np.ones((n, 1), bool)  # an empty row still has a prompt token; it predicts nothing
        response_ids = np.full((n, length), self.pad_id, np.int32)
        attention = np.zeros((n, length), bool)
        mask = np.zeros((n, length), bool)
        for i, index in enumerate(indices):
            row = self.rows[int(index)]
            tokens = (*row.prompt, *row.response)
            rest = len(tokens) - 1
            prompt_ids[i, 0] = tokens[0]
            response_ids[i, :rest] = tokens[1:]
            attention[i, :rest] = True
            mask[i, len(row.prompt) - 1 : rest] = row.mask
        return Experience(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                          response_mask=mask, response_attention=attention)


def load_sft_data(sft, data, tokenizer: Tokenizer, split: str, limits: dict[str, int]) -> Optional[SFTData]:
    """The ``split`` ("train" or "val") of the ``sft`` section's files, or of ``data.task``'s demonstrations without
    ``sft.train_files``; None for a held-out split that has none. ``limits``: the config keys that bound a row's
    tokens and their values (``sft.max_length``, a token budget)."""
    files = sft.train_files if split == "train" else sft.val_files
    if file_list(sft.train_files, "sft.train_files"):
        key = f"sft.{split}_files"
        paths = file_list(files, key)
        if not paths:
            return None
        rows = [tokenize_row(row, f"{path} {'row' if path.endswith('.parquet') else 'line'} {number}", sft, data,
                             tokenizer, limits)
                for path in paths for number, row in read_rows(path, key)]
        if not rows:
            raise ValueError(f"{key}={files!r} holds no rows")
    else:
        task = task_of(data)
        if task is None:
            raise ValueError("sft.train_files is not set and data.task='files' makes no demonstrations: give "
                             "sft.train_files (JSONL or Parquet rows)")
        count = data.num_train_examples if split == "train" else data.num_val_examples
        rows = [tokenize_row({sft.prompt_key: e.prompt, sft.completion_key: e.answer},
                             f"data.task={data.task!r} {split} example {i}", sft, data, tokenizer, limits)
                for i, e in enumerate(task.examples(split, count, data.seed))]
    return SFTData(rows, tokenizer.pad_id)


def tokenize_row(row: dict, where: str, sft, data, tokenizer: Tokenizer, limits: dict[str, int]) -> SFTRow:
    """One row as an :class:`SFTRow`: a chat when it has ``sft.messages_key``, else a prompt/completion pair."""
    if _has(row, sft.messages_key):
        pieces = chat_pieces(_lookup(row, sft.messages_key), where, sft.messages_key, data, tokenizer)
    else:
        missing = [f"{k!r} (sft.{name})" for name, k in (("prompt_key", sft.prompt_key),
                                                         ("completion_key", sft.completion_key)) if not _has(row, k)]
        if missing:
            raise ValueError(f"{where} has no key {' nor '.join(missing)}, nor chat messages {sft.messages_key!r} "
                             f"(sft.messages_key); its keys are {sorted(row)}")
        pieces = completion_pieces(row, where, sft, data, tokenizer)
    tokens, mask = [], []
    for ids, counted in pieces:
        tokens.extend(ids)
        mask.extend([counted] * len(ids))
    first = mask.index(True) if True in mask else len(mask)
    if first == 0:
        raise ValueError(f"{where}: the first token is already one the loss counts; a row needs at least one "
                         "prompt token to predict it from")
    for key, limit in limits.items():
        if len(tokens) > limit:
            raise ValueError(f"{where} has {len(tokens)} tokens > {key}={limit}: raise {key} or shorten the row")
    return SFTRow(tuple(tokens[:first]), tuple(tokens[first:]), tuple(mask[first:]))


def completion_pieces(row: dict, where: str, sft, data, tokenizer: Tokenizer) -> list[tuple[list[int], bool]]:
    """A prompt/completion pair: the prompt's tokens as the trainer makes them (BOS where the tokenizer adds one,
    or the chat template of one user turn with ``data.apply_chat_template``), the completion's and the EOS."""
    prompt, completion = _lookup(row, sft.prompt_key), _lookup(row, sft.completion_key)
    for key, name, value in ((sft.prompt_key, "prompt_key", prompt), (sft.completion_key, "completion_key",
                                                                        completion)):
        if not isinstance(value, str) or not value:
            what = "empty" if value == "" else f"a {type(value).__name__}"
            raise ValueError(f"{where}: {key!r} (sft.{name}) is {what}; it must be a non-empty string")
    if data.apply_chat_template:
        _require_template(tokenizer, where, f"{sft.prompt_key!r} (data.apply_chat_template=true)")
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], **data.apply_chat_template_kwargs)
        prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    else:
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=True)
    return [(prompt_ids, False), (tokenizer.encode(completion) + [tokenizer.eos_id], True)]


def chat_pieces(messages: Any, where: str, key: str, data, tokenizer: Tokenizer) -> list[tuple[list[int], bool]]:
    """A chat's tokens in pieces, each assistant turn's counted by the loss: the template renders the messages
    before turn ``i`` with the generation prompt, then the messages up to it without; the turn is the difference.
    A template whose rendering of fewer messages is not a prefix of its rendering of more cannot be cut by turns."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                 for m in messages):
        raise ValueError(f"{where}: {key!r} (sft.messages_key) must be a list of {{role, content}} messages")
    turns = [i for i, m in enumerate(messages) if m["role"] == ASSISTANT]
    if not turns:
        raise ValueError(f"{where}: {key!r} (sft.messages_key) has no assistant turn: nothing to learn")
    if turns[0] == 0:
        raise ValueError(f"{where}: {key}[0] is an assistant turn: a chat needs a turn before it to predict it from")
    for i in turns:
        content = messages[i]["content"]
        if not isinstance(content, str) or not content.strip():
            raise ValueError(f"{where}: {key}[{i}] is an assistant turn with empty content")
    _require_template(tokenizer, where, f"{key!r} (sft.messages_key)")
    kwargs = data.apply_chat_template_kwargs
    messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    pieces, done = [], ""
    for i in turns:
        before = tokenizer.apply_chat_template(messages[:i], **kwargs)
        through = tokenizer.apply_chat_template(messages[: i + 1], add_generation_prompt=False, **kwargs)
        if not before.startswith(done) or not through.startswith(before):
            raise ValueError(f"{where}: {key}[{i}]: the tokenizer's chat template does not render the conversation "
                             "turn by turn (an earlier rendering is not a prefix of a later one), so its assistant "
                             "tokens cannot be told apart")
        pieces += [(tokenizer.encode(before[len(done):]), False), (tokenizer.encode(through[len(before):]), True)]
        done = through
    return [(ids, counted) for ids, counted in pieces if ids]


def _require_template(tokenizer: Tokenizer, where: str, what: str) -> None:
    if not getattr(tokenizer, "has_chat_template", False):
        source = getattr(tokenizer, "source", "the built-in character vocabulary")
        raise ValueError(f"{where}: {what} needs a chat template, and tokenizer {source!r} has none "
                         "(no chat_template in tokenizer_config.json, no chat_template.jinja)")


def _has(row: dict, key: str) -> bool:
    try:
        _lookup(row, key)
    except KeyError:
        return False
    return True
