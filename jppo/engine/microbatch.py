"""Cutting a mini-batch into micro-batches of fixed shape, on the host, before it reaches the device.

Two ways to cut, one layout. A micro-batch holds *token rows* that the model runs on and *sequence slots* that
the losses see:

- token rows ``input_ids, positions, segment_ids``: ``[K, D, R, W]`` (K micro-batches, D batch shards, R rows of
  width W per shard). Segment ids mark which sequence a token belongs to (0 = padding), so several sequences
  packed in one row never attend to each other, and positions restart at 0 for each sequence;
- sequence slots ``slots``: the per-token fields of the :class:`~jppo.core.experience.Experience` (response mask, old
  log-probs, advantages, ...) as ``[K, D, S, L]``, one response per slot, response-aligned as in the rollout;
- ``gather_index [K, D, S, L]``: for response token ``j`` of slot ``s``, the flat index in the shard's ``R * W``
  token grid of the position whose next-token prediction is that token. The engine gathers per-token model
  outputs (log-probs, entropy, values) through it, so the losses never see the packing;
- ``row_ids [K, D, S]``: which sequence of the mini-batch sits in each slot (-1: empty), to put outputs back in
  order.

**Fixed** micro-batching (``micro_batch_size`` sequences per shard per micro-batch): one sequence per row, the
rollout's own layout (left-padded prompt, then the response); ``W = P + L``, ``R = S = micro_batch_size``.

**Token-budget** micro-batching (``max_token_len`` tokens per shard per micro-batch): the real tokens of each
sequence (prompt without padding, response up to its last token) are packed first-fit-decreasing into rows of
``W = max_token_len``; ``R = 1``. ``K`` is the largest number of rows any shard needs, and every shard runs that K,
the missing micro-batches being empty (they contribute exactly 0). K and S are rounded up to powers of two so that
a training run compiles the update a handful of times, not once per step.

Rows of the mini-batch go to shards in contiguous blocks (shard d holds rows ``[d N/D, (d+1) N/D)``), the layout
``jax.make_array_from_process_local_data`` expects when each process builds its own shards.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import numpy as np

from jppo.core.experience import Experience


@dataclasses.dataclass(frozen=True)
class MicroBatches:
    """Fixed-shape micro-batches of one mini-batch (see the module docstring for the layout); a pytree.

    ``slots`` is an :class:`~jppo.core.experience.Experience` holding only per-token fields, ``[K, D, S, L]``.
    """

    input_ids: np.ndarray
    positions: np.ndarray
    segment_ids: np.ndarray
    gather_index: np.ndarray
    slots: Optional[Experience]
    row_ids: Optional[np.ndarray]
    # routing replay: each token's recorded experts [..., R, W, Ls, k] (jppo.rollout.routing); None: the router's own
    routed_experts: Optional[np.ndarray] = None

    @property
    def num_micro_batches(self) -> int:
        return self.input_ids.shape[0]

    def device_arrays(self) -> "MicroBatches":
        """What the update step needs (``row_ids`` stays on the host)."""
        return dataclasses.replace(self, row_ids=None)

    def token_rows(self) -> "MicroBatches":
        """Only what the model runs on (forward passes)."""
        return dataclasses.replace(self, slots=None, row_ids=None)


jax.tree_util.register_dataclass(
    MicroBatches, data_fields=[f.name for f in dataclasses.fields(MicroBatches)], meta_fields=[]
)


def next_power_of_two(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _shard_rows(num_sequences: int, num_shards: int) -> np.ndarray:
    if num_sequences % num_shards:
        raise ValueError(f"{num_sequences} sequences cannot be split evenly over {num_shards} batch shards")
    return np.arange(num_sequences).reshape(num_shards, num_sequences // num_shards)


def _slots(batch: Experience, row_ids: np.ndarray) -> Experience:
    """Every per-token field gathered into slots ``[..., S, L]``; empty slots (-1) hold zeros (mask False)."""
    present = (row_ids >= 0)[..., None]
    safe = np.where(row_ids >= 0, row_ids, 0)
    slots = jax.tree.map(lambda v: np.where(present, v[safe], 0).astype(v.dtype), batch.per_token())
    return dataclasses.replace(slots, response_mask=slots.response_mask.astype(bool))


def fixed_cut(num_sequences: int, num_shards: int, micro_batch_size: int) -> np.ndarray:
    """``row_ids [K, D, m]`` of the fixed cut: micro-batch k of shard d is the k-th block of ``m`` of that shard's
    rows (one sequence per token row, so every offset is 0)."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    shards = _shard_rows(num_sequences, num_shards)
    per_shard = shards.shape[1]
    if micro_batch_size > per_shard:
        raise ValueError(
            f"micro-batch of {micro_batch_size} sequences per shard is larger than the {per_shard} sequences each of "
            f"the {num_shards} shards holds"
        )
    if per_shard % micro_batch_size:
        raise ValueError(
            f"{per_shard} sequences per shard cannot be cut into micro-batches of {micro_batch_size}"
        )
    k = per_shard // micro_batch_size
    # [D, K, m] -> [K, D, m]
    return shards.reshape(num_shards, k, micro_batch_size).transpose(1, 0, 2).astype(np.int32)


def fixed_micro_batches(batch: Experience, num_shards: int, micro_batch_size: int) -> MicroBatches:
    """``micro_batch_size`` sequences per shard per micro-batch, one sequence per row."""
    row_ids = fixed_cut(batch.num_sequences, num_shards, micro_batch_size)
    k = row_ids.shape[0]
    p = batch.prompt_ids.shape[1]
    length = batch.response_ids.shape[1]
    ids = np.concatenate([batch.prompt_ids, batch.response_ids], axis=1)
    real = np.concatenate([batch.prompt_mask.astype(bool), batch.response_attention.astype(bool)], axis=1)
    positions = np.maximum(np.cumsum(real, axis=1) - 1, 0)
    segments = real.astype(np.int32)
    return MicroBatches(
        input_ids=np.where(real, ids, 0)[row_ids].astype(np.int32),
        positions=positions[row_ids].astype(np.int32),
        segment_ids=segments[row_ids],
        gather_index=np.broadcast_to(
            fixed_gather_index(micro_batch_size, p, length), (k, num_shards, micro_batch_size, length)
        ).astype(np.int32),
        slots=_slots(batch, row_ids),
        row_ids=row_ids,
    )


def fixed_gather_index(micro_batch_size: int, prompt_length: int, response_length: int) -> np.ndarray:
    """``[m, L]`` of the fixed layout: rows of a shard's micro-batch lie one after another, ``P + L`` wide, and
    response token j of row r is predicted at column ``P - 1 + j`` of that row."""
    slot_in_row = np.arange(micro_batch_size)[:, None] * (prompt_length + response_length)
    return slot_in_row + (prompt_length - 1) + np.arange(response_length)[None, :]


def _first_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


def packed_cut(lengths: np.ndarray, num_shards: int, max_token_len: int) -> tuple[np.ndarray, np.ndarray]:
    """``row_ids [K, D, S]`` and ``offsets [K, D, S]`` of the token-budget cut, from the sequences' real lengths
    alone: each shard's sequences packed first-fit-decreasing into rows of ``max_token_len``, slot s of a row
    starting at column ``offsets`` (the sum of the lengths before it); K and S rounded up to powers of two."""
    longest = int(lengths.max()) if len(lengths) else 0
    if max_token_len < longest:
        raise ValueError(
            f"ppo_max_token_len={max_token_len} is smaller than the longest sequence ({longest} tokens)"
        )
    shards = _shard_rows(len(lengths), num_shards)
    shard_bins = [
        [shards[d][b] for b in _first_fit_decreasing(lengths[shards[d]], max_token_len)] for d in range(num_shards)
    ]
    k = next_power_of_two(max(len(bins) for bins in shard_bins))
    s = next_power_of_two(max(len(b) for bins in shard_bins for b in bins))
    row_ids = np.full((k, num_shards, s), -1, np.int32)
    offsets = np.zeros((k, num_shards, s), np.int32)
    for d, bins in enumerate(shard_bins):
        for b, members in enumerate(bins):
            row_ids[b, d, : len(members)] = members
            offsets[b, d, : len(members)] = np.cumsum([0] + [lengths[row] for row in members[:-1]])
    return row_ids, offsets


def packed_micro_batches(batch: Experience, num_shards: int, max_token_len: int) -> MicroBatches:
    """Sequences packed into one row of ``max_token_len`` tokens per shard per micro-batch."""
    row_ids, offsets = packed_cut(batch.lengths(), num_shards, max_token_len)
    k, _, s = row_ids.shape
    length = batch.response_ids.shape[1]
    input_ids = np.zeros((k, num_shards, 1, max_token_len), np.int32)
    positions = np.zeros_like(input_ids)
    segment_ids = np.zeros_like(input_ids)
    gather = np.zeros((k, num_shards, s, length), np.int32)
    prompt_mask = batch.prompt_mask.astype(bool)
    attention = batch.response_attention.astype(bool)
    for b, d, slot in zip(*np.nonzero(row_ids >= 0)):
        row, offset = row_ids[b, d, slot], offsets[b, d, slot]
        prompt = batch.prompt_ids[row][prompt_mask[row]]
        response = batch.response_ids[row][attention[row]]
        tokens = np.concatenate([prompt, response])
        span = slice(offset, offset + len(tokens))
        input_ids[b, d, 0, span] = tokens
        positions[b, d, 0, span] = np.arange(len(tokens))
        segment_ids[b, d, 0, span] = slot + 1
        # Response token j (of those that exist) is predicted at position offset + len(prompt) + j - 1.
        existing = np.flatnonzero(attention[row])
        gather[b, d, slot, existing] = offset + len(prompt) - 1 + np.arange(len(existing))
    return MicroBatches(input_ids, positions, segment_ids, gather, _slots(batch, row_ids), row_ids)


def make_micro_batches(
    batch: Experience,
    num_shards: int,
    *,
    micro_batch_size: int | None = None,
    max_token_len: int | None = None,
) -> MicroBatches:
    """Fixed micro-batches when ``micro_batch_size`` is given, token-budget packing when ``max_token_len`` is."""
    if (micro_batch_size is None) == (max_token_len is None):
        raise ValueError("give exactly one of micro_batch_size (fixed) or max_token_len (token budget)")
    if micro_batch_size is not None:
        return fixed_micro_batches(batch, num_shards, micro_batch_size)
    return packed_micro_batches(batch, num_shards, max_token_len)


def cut_micro_batches(
    lengths: np.ndarray, num_shards: int, *, micro_batch_size: int | None = None, max_token_len: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The cut of :func:`make_micro_batches` without its arrays: ``row_ids [K, D, S]`` and ``offsets [K, D, S]``,
    from the sequences' real lengths (prompt + existing response tokens) alone."""
    if (micro_batch_size is None) == (max_token_len is None):
        raise ValueError("give exactly one of micro_batch_size (fixed) or max_token_len (token budget)")
    if micro_batch_size is not None:
        row_ids = fixed_cut(len(lengths), num_shards, micro_batch_size)
        return row_ids, np.zeros_like(row_ids)
    return packed_cut(np.asarray(lengths), num_shards, max_token_len)


def scatter_back(values: np.ndarray, row_ids: np.ndarray, num_sequences: int) -> np.ndarray:
    """Puts slot-shaped outputs ``[K, D, S, ...]`` back into mini-batch order ``[N, ...]``."""
    flat_rows = row_ids.reshape(-1)
    flat_values = values.reshape(flat_rows.shape[0], *values.shape[3:])
    out = np.zeros((num_sequences, *values.shape[3:]), values.dtype)
    present = flat_rows >= 0
    out[flat_rows[present]] = flat_values[present]
    return out


def _pad_axis(array: np.ndarray, axis: int, size: int, value) -> np.ndarray:
    if array.shape[axis] == size:
        return array
    widths = [(0, 0)] * array.ndim
    widths[axis] = (0, size - array.shape[axis])
    return np.pad(array, widths, constant_values=value)


def pad_cut(
    row_ids: np.ndarray, offsets: np.ndarray, num_micro_batches: int, num_slots: int
) -> tuple[np.ndarray, np.ndarray]:
    """A ``[K, D, S]`` cut (:func:`cut_micro_batches`) padded to ``num_micro_batches`` x ``num_slots`` with empty
    slots (row id -1, offset 0), so cuts of several steps or processes stack into one array."""
    widths = ((0, num_micro_batches - row_ids.shape[0]), (0, 0), (0, num_slots - row_ids.shape[2]))
    return np.pad(row_ids, widths, constant_values=-1), np.pad(offsets, widths, constant_values=0)


def pad_micro_batches(micro: MicroBatches, num_micro_batches: int, num_slots: int) -> MicroBatches:
    """``micro`` with K and S padded to the given sizes by empty micro-batches and empty slots (fully masked:
    they contribute exactly 0). Processes pad to the same sizes so that their parts form one global array."""
    k, s = num_micro_batches, num_slots

    def pad(array: np.ndarray, slot_axis: int | None, value) -> np.ndarray:
        array = _pad_axis(array, 0, k, value)
        return array if slot_axis is None else _pad_axis(array, slot_axis, s, value)

    return MicroBatches(
        input_ids=pad(micro.input_ids, None, 0),
        positions=pad(micro.positions, None, 0),
        segment_ids=pad(micro.segment_ids, None, 0),
        gather_index=pad(micro.gather_index, 2, 0),
        slots=jax.tree.map(lambda array: pad(array, 2, 0), micro.slots),  # zeros: the mask is False there
        row_ids=pad(micro.row_ids, 2, -1),
    )


def stack_micro_batches(steps: list[MicroBatches], num_micro_batches: int = 0, num_slots: int = 0) -> MicroBatches:
    """Several mini-batches' micro-batches as one ``[M, K, D, ...]`` layout, so all M optimizer steps run in one
    compiled call. K and S are padded to the largest among the steps (or the given sizes, if larger) with empty
    micro-batches and empty slots; token rows must already agree in ``R`` and ``W``."""
    k = max([num_micro_batches] + [m.input_ids.shape[0] for m in steps])
    s = max([num_slots] + [m.row_ids.shape[2] for m in steps])
    padded = [pad_micro_batches(m, k, s) for m in steps]
    return jax.tree.map(lambda *arrays: np.stack(arrays), *padded)
