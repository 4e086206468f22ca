"""What a step trains on of what it sampled: DAPO's dynamic sampling (only prompt groups whose responses
disagree), its overlong filter and rollout correction's rejection (rows out of the loss).

A group whose ``rollout.n`` responses all get the same reward has zero group-relative advantage everywhere, so it
adds nothing to the policy gradient but still counts in the normalizers (it dilutes the step). With
``algorithm.filter_groups.enable`` the collector drops such groups and samples further prompt batches until
``data.train_batch_size`` varied groups are kept (the first ones, in sampling order; the surplus of the last batch
is dropped, as verl does), so the kept batch has the usual fixed shape of ``train_batch_size x n`` rows.

This module holds the batch arithmetic (which groups vary, selecting and joining groups); the sampling loop is
:func:`jppo.run.collect.sample_and_score`.

A filtered row stays in the batch with its response mask cleared (:func:`kept_rows_only`), so every loss term skips
it and the mini-batch's normalizers count the kept rows only, before the batch is cut: the contract holds.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jppo.core.checks import choice, register_config_check
from jppo.core.experience import Experience
from jppo.losses import REJECTION_MODES, RolloutCorrection, rejected_rows
from jppo.parallel.hostlocal import sum_over_processes

FILTER_METRICS = ("reward", "score")


@register_config_check("algorithm.filter_groups.metric", rl_only=True)
def check_metric(cfg) -> None:
    choice("algorithm.filter_groups.metric", cfg.algorithm.filter_groups.metric, FILTER_METRICS)


class DynamicSamplingError(RuntimeError):
    """More prompt batches than ``algorithm.filter_groups.max_num_gen_batches`` did not yield a full batch."""


def varied_groups(values: np.ndarray, group_ids: np.ndarray) -> np.ndarray:
    """The group ids, in order of first appearance, whose rows' ``values`` are not all equal."""
    values, group_ids = np.asarray(values), np.asarray(group_ids)
    order = list(dict.fromkeys(group_ids.tolist()))
    return np.asarray([g for g in order if np.ptp(values[group_ids == g]) > 0], np.int64)


def sampling_metrics(num_varied: list[int], batch_size: int) -> dict[str, float]:
    """The metrics of one step's dynamic sampling, from the number of varied groups in each prompt batch drawn.

    Of the ``D = len(num_varied) * batch_size`` groups drawn, ``varied_fraction = sum(num_varied) / D`` had responses
    that disagree and ``kept_fraction = min(sum(num_varied), batch_size) / D`` entered the batch: the last batch may
    hold more varied groups than the batch still needed, and its surplus is dropped."""
    drawn, varied = len(num_varied) * batch_size, int(sum(num_varied))
    return {
        "filter_groups/num_gen_batches": float(len(num_varied)),
        "filter_groups/varied_fraction": varied / drawn,
        "filter_groups/kept_fraction": min(varied, batch_size) / drawn,
    }


@dataclasses.dataclass(frozen=True)
class Scored:
    """A sampled, scored batch: the sequences (``group_ids`` index ``examples``/``prompts``), and per row the
    decoded text, whether it ended with EOS, the task score, and the training reward (the score plus shaping)."""

    exp: Experience
    examples: list
    prompts: list
    texts: list[str]
    finished: list[bool]
    scores: np.ndarray
    rewards: np.ndarray

    @property
    def row_examples(self) -> list:
        return [self.examples[g] for g in self.exp.group_ids.tolist()]

    def groups(self, ids: np.ndarray) -> "Scored":
        """The rows of groups ``ids`` (in that order), renumbered ``0 .. len(ids) - 1``."""
        ids = np.asarray(ids, np.int64)
        rows = np.concatenate([np.flatnonzero(self.exp.group_ids == g) for g in ids.tolist()] or [np.zeros(0, int)])
        new_ids = np.repeat(np.arange(len(ids)), [int(np.sum(self.exp.group_ids == g)) for g in ids.tolist()])
        exp = dataclasses.replace(self.exp.take(rows), group_ids=new_ids)
        return Scored(
            exp=exp, examples=[self.examples[g] for g in ids.tolist()], prompts=[self.prompts[g] for g in ids.tolist()],
            texts=[self.texts[r] for r in rows.tolist()], finished=[self.finished[r] for r in rows.tolist()],
            scores=self.scores[rows], rewards=self.rewards[rows],
        )


def left_pad(array: np.ndarray, width: int, value, prompt_width: int | None = None) -> np.ndarray:
    """``array`` ``[N, P, ...]`` with ``width - P`` columns of ``value`` in front (``prompt_width``: ``P``, when the
    array has more columns than the prompt's, e.g. a routing record's prompt and response columns)."""
    front = width - (array.shape[1] if prompt_width is None else prompt_width)
    return np.pad(array, ((0, 0), (front, 0)) + ((0, 0),) * (array.ndim - 2), constant_values=value)


def concat(parts: list[Scored], pad_id: int) -> Scored:
    """The parts one after another; prompts left-padded to the widest part, group ids renumbered consecutively."""
    width = max(p.exp.prompt_ids.shape[1] for p in parts)
    offsets = np.cumsum([0] + [len(p.examples) for p in parts])

    def field(name: str):
        arrays = [getattr(p.exp, name) for p in parts]
        if arrays[0] is None:
            return None
        if name == "prompt_ids":
            arrays = [left_pad(a, width, pad_id) for a in arrays]
        elif name == "prompt_mask":
            arrays = [left_pad(a, width, False) for a in arrays]
        elif name == "routed_experts":  # the prompt's columns come first: padded like the prompts, not recorded
            arrays = [
                left_pad(a, width, np.iinfo(a.dtype).max, p.exp.prompt_ids.shape[1]) for a, p in zip(arrays, parts)
            ]
        elif name == "group_ids":
            arrays = [a + offset for a, offset in zip(arrays, offsets)]
        return np.concatenate(arrays)

    exp = Experience(**{f.name: field(f.name) for f in dataclasses.fields(Experience)})
    return Scored(
        exp=exp, examples=[e for p in parts for e in p.examples], prompts=[q for p in parts for q in p.prompts],
        texts=[t for p in parts for t in p.texts], finished=[d for p in parts for d in p.finished],
        scores=np.concatenate([p.scores for p in parts]), rewards=np.concatenate([p.rewards for p in parts]),
    )


def kept_rows_only(response_mask: np.ndarray, keep) -> np.ndarray:
    """The response mask with the rows not in ``keep`` (``[N]`` bool) cleared, so every loss term skips them and
    the mini-batch normalizers (N tokens, S sequences) count the kept rows only: how the overlong filter and the
    rollout-correction rejection remove rows, before the batch is cut (so the contract holds)."""
    return np.where(np.asarray(keep, bool)[:, None], response_mask, False).astype(response_mask.dtype)


def overlong_filtered(exp: Experience, ended_eos) -> Experience:
    """``algorithm.overlong_filter``: ``exp`` with the truncated rows (:func:`truncated_rows`) out of the loss
    mask (:func:`kept_rows_only`). DAPO masks them because a response cut by the length limit is scored on an
    answer it never finished: its reward says nothing about its tokens."""
    kept = ~truncated_rows(exp, ended_eos)
    return dataclasses.replace(exp, response_mask=kept_rows_only(exp.response_mask, kept))


def truncated_rows(batch: Experience, ended_eos) -> np.ndarray:
    """Which rows ``rollout.max_response_length`` cut before they ended (``[N]`` bool; what the overlong filter
    masks and validation records report as not ``finished``). A multi-turn batch says so itself
    (``batch.truncated``: an episode ended by the environment or the turn limit is not truncated, even without
    EOS); a single-turn response stops only at EOS or at the limit, so it was cut iff it has no EOS
    (``ended_eos``, :func:`decode_responses`)."""
    if batch.truncated is not None:
        return np.asarray(batch.truncated, bool)
    return ~np.asarray(ended_eos, bool)


def rejected_rows_cleared(exp: Experience, correction: RolloutCorrection) -> tuple[Experience, dict[str, float]]:
    """verl's rejection sampling (``seq_rs`` / ``geo_rs``, :mod:`jppo.losses.rollout_correction`): the batch with
    the response mask of every rejected row cleared, so every loss term and the normalizers N and S skip those rows
    (as the overlong filter does), and ``rollout_corr/rejected_fraction``, the fraction of non-empty rows removed
    (whole batch, combined over processes). Other modes: the batch as it is, no metric."""
    if correction.mode not in REJECTION_MODES:
        return exp, {}
    mask = np.asarray(exp.response_mask)
    rejected = np.asarray(rejected_rows(exp.old_log_prob, exp.rollout_log_prob, mask, correction))
    sequences = mask.astype(bool).any(axis=1)
    removed, total = sum_over_processes(np.array([(rejected & sequences).sum(), sequences.sum()], np.float64))
    fraction = float(removed / max(total, 1))
    exp = dataclasses.replace(exp, response_mask=kept_rows_only(mask, ~rejected))
    return exp, {"rollout_corr/rejected_fraction": fraction}
