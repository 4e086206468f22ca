"""Held-out evaluation: ``rollout.val_n`` responses per held-out prompt, scored as training scores its rollouts.

The training loop evaluates every ``trainer.val_every`` steps through :func:`evaluate`; ``python -m jppo.eval``
evaluates once, through the same function, and writes the result (:func:`evaluate_and_write`), so for one
checkpoint and seed the numbers are those the training run logged. The command's policy is the config's model
(``model.path``, or random initialisation from ``trainer.seed``) or a trained one (its models rebuilt as the
checkpoint records them, whatever ``trainer.seed`` says): ``trainer.resume`` as in training (``auto``: the newest
checkpoint of ``trainer.output_dir``, if any; a checkpoint directory; or a run's output directory, meaning its
newest checkpoint). The prompts are the validation set (``data.val_files``, or the built-in task's held-out split).
Written into ``--out`` (default ``trainer.output_dir``):

- ``eval.json``: ``metrics`` (``val/reward/mean``; ``val/accuracy``, the fraction of responses solved, which is
  pass@1; ``val/pass@k`` for k = 2, 4, ... up to ``val_n`` and ``val_n`` itself, the unbiased estimator
  ``1 - C(n-c, k) / C(n, k)`` averaged over prompts), the ``checkpoint`` evaluated (``null``: the config's model),
  its ``step`` and the resolved ``config``;
- ``generations.jsonl``: one line per response, ``{index, sample, prompt, response, reward, finished}`` in
  validation-set order (``index``: the prompt's position, ``sample``: which of its ``val_n`` responses).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Optional

import jax
import numpy as np
from etils import epath
from flax import nnx
from jax.experimental import multihost_utils

from jppo.config import to_dict
from jppo.parallel import distributed
from jppo.parallel.hostlocal import gathered, sum_over_rows
from jppo.run.collect import Collector, sample
from jppo.run.filters import truncated_rows
from jppo.run.state import RunState
from jppo.runlog import RunLogger

log = logging.getLogger("jppo.run.evaluate")
EVAL_FILE = "eval.json"
GENERATIONS_FILE = "generations.jsonl"


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """One pass of the policy over the held-out prompts: the metrics (whole validation set, combined over
    processes) and this process's responses as records ``{index, sample, prompt, response, reward, finished}``
    (``index``: the prompt's position in the validation set, ``sample``: which of its ``rollout.val_n``,
    ``finished``: not cut by the length limit, :func:`jppo.run.filters.truncated_rows`)."""

    metrics: dict[str, float]
    records: list[dict]


def pass_at_k_sizes(n: int) -> list[int]:
    """The ``k`` reported for ``n`` samples per prompt: the powers of 2 up to ``n``, and ``n`` itself."""
    sizes = [1 << i for i in range(n.bit_length()) if 1 << i <= n]
    return sizes if sizes[-1] == n else sizes + [n]


def pass_at_k(n: int, c: np.ndarray, k: int) -> np.ndarray:
    """The unbiased estimate of the probability that at least one of ``k`` samples drawn without replacement from
    ``n`` (of which ``c`` are correct) is correct: ``1 - C(n - c, k) / C(n, k)``, computed as the product
    ``prod_{i = n-c+1}^{n} (1 - k / i)`` (Chen et al. 2021), which is exact in floating point and never overflows."""
    c = np.asarray(c)
    out = np.ones(c.shape, np.float64)
    for row, correct in np.ndenumerate(c):
        if n - correct >= k:
            out[row] = 1.0 - np.prod(1.0 - k / np.arange(n - correct + 1, n + 1))
    return out


def evaluation_metrics(reward_sum: float, correct: np.ndarray, prompts: int, n: int) -> dict[str, float]:
    """``val/reward/mean`` (over all ``prompts x n`` responses), ``val/accuracy`` (the fraction solved, which is
    pass@1) and ``val/pass@k`` for the other ``k`` of :func:`pass_at_k_sizes`, from the whole evaluation's reward
    sum and per-prompt counts of solved samples ``correct`` (every process passes the same, in prompt order)."""
    sizes = [k for k in pass_at_k_sizes(n) if k > 1]
    out = {"val/reward/mean": reward_sum / (prompts * n), "val/accuracy": float(correct.sum()) / (prompts * n)}
    out.update({f"val/pass@{k}": float(pass_at_k(n, correct, k).sum()) / prompts for k in sizes})
    return {k: float(v) for k, v in out.items()}


def evaluate(c: Collector, params: nnx.State) -> Evaluation:
    """Rewards of ``rollout.val_n`` samples per held-out prompt (greedy when ``rollout.val_temperature`` is 0),
    scored like training rollouts (:meth:`Collector.score`). The sampling keys depend on the seed and the batch
    only, so a policy gets the same evaluation whenever it is evaluated (during training or by ``jppo.eval``).
    Each process samples and scores its rows; the metrics combine them over processes."""
    cfg, data, n = c.cfg, c.inputs.val_data, c.cfg.rollout.val_n
    params = c.sampling_weights(params)[0]  # on the rollout's own mesh when it has one
    reward_sum, correct, records, start = 0.0, [], [], 0
    for index, (examples, prompts) in enumerate(data.batches(cfg.data.val_batch_size)):
        key = jax.random.fold_in(jax.random.key(cfg.trainer.seed + 7), index)
        batch = sample(c.val_sampler, params, prompts, key, examples)
        texts, finished, scores = c.score(batch, [examples[i] for i in batch.group_ids])
        truncated = truncated_rows(batch, finished).tolist()
        solved = (scores >= 1.0 - 1e-6).reshape(-1, n)  # rows of one prompt are adjacent and on one process
        # each batch's global sums, added in batch order: the same bits on any number of processes
        reward_sum += float(sum_over_rows(scores[:, None])[0])
        correct.extend(gathered(solved.sum(axis=1), tiled=True).tolist())
        for row, group in enumerate(batch.group_ids.tolist()):
            records.append({
                "index": start + group, "sample": row % n, "prompt": examples[group].prompt, "response": texts[row],
                "reward": float(scores[row]), "finished": not truncated[row],
            })
        start += len(examples)
    metrics = evaluation_metrics(reward_sum, np.asarray(correct, np.int64), len(data), n) | c.reward_failures("val/")
    return Evaluation(metrics, records)


def evaluate_and_write(collector: Collector, state: RunState, checkpoint: Optional[str], out: epath.Path) -> dict:
    """Evaluates ``state``'s policy (the config's, or the one restored from ``checkpoint``) and writes ``eval.json``
    and ``generations.jsonl`` into ``out`` (main process); returns what ``eval.json`` holds."""
    if checkpoint is not None:
        log.info("evaluating %s (step %d)", checkpoint, int(state.step))
    result = evaluate(collector, state.actor.weights)
    records = sorted(all_processes(result.records), key=lambda r: (r["index"], r["sample"]))
    cfg = collector.cfg
    report = {"metrics": result.metrics, "checkpoint": checkpoint, "step": int(state.step), "config": to_dict(cfg)}
    if distributed.is_main_process():
        out.mkdir(parents=True, exist_ok=True)
        (out / EVAL_FILE).write_text(json.dumps(report, indent=1) + "\n")
        lines = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
        (out / GENERATIONS_FILE).write_text(lines, encoding="utf-8")
    return report


def all_processes(records: list[dict]) -> list[dict]:
    """The records of every process (each process passes its own), sent as padded UTF-8 JSON bytes."""
    if jax.process_count() == 1:
        return records
    data = np.frombuffer(json.dumps(records).encode(), np.uint8)
    longest = int(np.max(multihost_utils.process_allgather(np.asarray([len(data)]))))
    padded = np.zeros(longest, np.uint8)
    padded[: len(data)] = data
    gathered = multihost_utils.process_allgather(padded)
    return [record for row in gathered for record in json.loads(bytes(row).rstrip(b"\0").decode())]


def evaluate_and_log(collector: Collector, state: RunState, step: int, logger: RunLogger) -> dict[str, float]:
    """The policy's held-out evaluation metrics; its first ``trainer.log_val_generations`` responses (the main
    process's rows, in validation-set order: the same prompts every time) go to the logger as step ``step``'s
    sample."""
    result = evaluate(collector, state.actor.weights)
    sample = result.records[: collector.cfg.trainer.log_val_generations]
    logger.log_generations(step, [{k: r[k] for k in ("prompt", "response", "reward", "finished")} for r in sample])
    return result.metrics
