"""DAPO's dynamic sampling: train only on prompt groups whose responses disagree.

A group whose ``rollout.n`` responses all get the same reward has zero group-relative advantage everywhere, so it
adds nothing to the policy gradient but still counts in the normalizers (it dilutes the step). With
``algorithm.filter_groups.enable`` the collector drops such groups and samples further prompt batches until
``data.train_batch_size`` varied groups are kept (the first ones, in sampling order; the surplus of the last batch
is dropped, as verl does), so the kept batch has the usual fixed shape of ``train_batch_size x n`` rows.

This module holds the batch arithmetic (which groups vary, selecting and joining groups); the sampling loop is
:func:`jppo.run.collect.sample_and_score`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jppo.core.checks import choice, register_config_check
from jppo.core.experience import Experience

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
            arrays = [left_pad(a, width, np.iinfo(a.dtype).max, p.exp.prompt_ids.shape[1]) for a, p in zip(arrays, parts)]
        elif name == "group_ids":
            arrays = [a + offset for a, offset in zip(arrays, offsets)]
        return np.concatenate(arrays)

    exp = Experience(**{f.name: field(f.name) for f in dataclasses.fields(Experience)})
    return Scored(
        exp=exp, examples=[e for p in parts for e in p.examples], prompts=[q for p in parts for q in p.prompts],
        texts=[t for p in parts for t in p.texts], finished=[d for p in parts for d in p.finished],
        scores=np.concatenate([p.scores for p in parts]), rewards=np.concatenate([p.rewards for p in parts]),
    )
