"""How to sample: :class:`SamplingParams`, the static settings of a compiled rollout (:mod:`jppo.rollout.decode`)."""

from __future__ import annotations

import dataclasses

import numpy as np

from jppo.core.errors import InvalidSetting


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample; hashable, so it is a static argument of the compiled program.

    Attributes:
        max_new_tokens: response slots per row (at least 1).
        temperature: logits are divided by it; must be positive unless ``greedy``.
        top_k: keep the ``k`` most likely tokens; ``0`` switches the filter off.
        top_p: keep the smallest set of most likely tokens whose probability reaches ``top_p``; ``1`` is off.
        greedy: take the most likely token (the key, ``top_k`` and ``top_p`` are then unused).
        n: samples per prompt.
        eos_token_ids: tokens that end a response (included in it).
        pad_token_id: fills response slots after the end.
        max_num_seqs: rows decoded at once (continuous batching: a finished row's slot is refilled with the next
            waiting row); ``0``, or at least the number of rows, decodes every row together.
        cache_blocks: the most blocks the response cache is stored in (:func:`cache_block_count`); ``0`` chooses
            by backend. Tokens and log-probs are bitwise the same for one block count; across block counts they
            differ by the rounding of combining per-block softmax sums.
        record_routing: a model with experts also returns each token's experts (routing replay,
            :mod:`jppo.rollout.routing`).
        bitwise: sample on the decoder's bitwise path (:mod:`jppo.rollout.bitwise`, ``trainer.deterministic:
            bitwise``): a row's tokens and log-probs have the same bits on any device count, and its log-probs are
            the trainer's.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False
    n: int = 1
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0
    max_num_seqs: int = 0
    cache_blocks: int = 0
    record_routing: bool = False
    bitwise: bool = False

    def __post_init__(self) -> None:
        # A list would make the params unhashable and so unusable as a static argument.
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))
        for name in ("max_new_tokens", "top_k", "n", "pad_token_id", "max_num_seqs", "cache_blocks"):
            if not isinstance(getattr(self, name), (int, np.integer)):
                raise InvalidSetting("SamplingParams.", name, getattr(self, name), "an integer")
        problems = {
            "max_new_tokens": (self.max_new_tokens, self.max_new_tokens >= 1, "an integer >= 1"),
            "temperature": (self.temperature, self.greedy or self.temperature > 0, "> 0 (or greedy=True)"),
            "top_k": (self.top_k, self.top_k >= 0, "an integer >= 0 (0 = off)"),
            "top_p": (self.top_p, 0 < self.top_p <= 1, "in (0, 1] (1 = off)"),
            "n": (self.n, self.n >= 1, "an integer >= 1"),
            "pad_token_id": (self.pad_token_id, self.pad_token_id >= 0, "a token id >= 0"),
            "max_num_seqs": (self.max_num_seqs, self.max_num_seqs >= 0, "an integer >= 0 (0 = every row at once)"),
            "cache_blocks": (self.cache_blocks, self.cache_blocks >= 0, "an integer >= 0 (0 = by backend)"),
            "eos_token_ids": (self.eos_token_ids, all(t >= 0 for t in self.eos_token_ids), "token ids >= 0"),
        }
        for name, (value, ok, valid) in problems.items():
            if not ok:
                raise InvalidSetting("SamplingParams.", name, value, valid)
        for name in ("max_num_seqs", "record_routing"):  # the bitwise sampler decodes every row, routing as trained
            if self.bitwise and getattr(self, name):
                raise InvalidSetting("SamplingParams.", name, getattr(self, name), "0 / False with bitwise=True")
