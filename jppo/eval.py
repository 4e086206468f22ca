"""``python -m jppo.eval --config CFG [key=value ...] [--out DIR]``: evaluation only, on the held-out prompts.

The policy is the config's model (``model.path``, or random initialisation from ``trainer.seed``) or a trained one
(its models rebuilt as the checkpoint records them, whatever ``trainer.seed`` says):
``trainer.resume`` as in training (``auto``: the newest checkpoint of ``trainer.output_dir``, if any; a checkpoint
directory; or a run's output directory, meaning its newest checkpoint). It samples ``rollout.val_n`` responses per
prompt of the validation set (``data.val_files``, or the built-in task's held-out split) and scores them through
:func:`jppo.run.collect.validate`, the function the trainer's validation runs, so for one checkpoint and seed the
numbers are those the training run logged. Written into ``--out`` (default ``trainer.output_dir``):

- ``eval.json``: ``metrics`` (``val/reward/mean``; ``val/accuracy``, the fraction of responses solved, which is
  pass@1; ``val/pass@k`` for k = 2, 4, ... up to ``val_n`` and ``val_n`` itself, the unbiased estimator
  ``1 - C(n-c, k) / C(n, k)`` averaged over prompts), the ``checkpoint`` evaluated (``null``: the config's model),
  its ``step`` and the resolved ``config``;
- ``generations.jsonl``: one line per response, ``{index, sample, prompt, response, reward, finished}`` in
  validation-set order (``index``: the prompt's position, ``sample``: which of its ``val_n`` responses).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Optional, Sequence

import jax
import numpy as np
from etils import epath
from jax.experimental import multihost_utils

from jppo.run import build, compile_cache
from jppo.parallel import distributed
from jppo.run.collect import validate
from jppo.config import CONFIG_HELP, ConfigError, TrainConfig, check_mesh, load_config, to_dict
from jppo.parallel.distributed import DistributedError
from jppo.core.errors import one_line
from jppo.parallel.mesh import make_mesh
from jppo.models import CheckpointError
from jppo.core.paths import run_path
from jppo.train import plan_resume, restore

log = logging.getLogger("jppo.eval")
EVAL_FILE = "eval.json"
GENERATIONS_FILE = "generations.jsonl"


def evaluate(
    cfg: TrainConfig, mesh_shape: tuple[int, int, int], inputs: build.RunInputs, out: epath.Path,
    devices: Optional[Sequence[jax.Device]] = None,
) -> dict:
    """Validates the config's policy, or the checkpoint ``trainer.resume`` points at, and writes ``eval.json`` and
    ``generations.jsonl`` into ``out`` (main process); returns what ``eval.json`` holds."""
    mesh = make_mesh(*mesh_shape, devices=devices)
    resume = plan_resume(cfg, run_path(cfg.trainer.output_dir) / "checkpoints")  # a local folder or a gs:// URI
    state, collector, _, _, _ = restore(cfg, mesh, inputs, resume)
    checkpoint = resume.checkpoint
    if checkpoint is not None:
        log.info("evaluating %s (step %d)", checkpoint, state.steps_done)
    result = validate(collector, state.actor.weights)
    records = sorted(all_processes(result.records), key=lambda r: (r["index"], r["sample"]))
    report = {"metrics": result.metrics, "checkpoint": checkpoint, "step": state.steps_done, "config": to_dict(cfg)}
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


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m jppo.eval", description="Evaluate a policy (a model or a checkpoint) on the held-out prompts."
    )
    parser.add_argument("--config", help=CONFIG_HELP)
    parser.add_argument("--out", help="output directory (default: trainer.output_dir)")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. trainer.resume=runs/quickstart")
    distributed.add_arguments(parser)
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        cache = compile_cache.apply(cfg.trainer.compilation_cache)  # before anything compiles
        log.info("compilation cache: %s", cache or "off")
        distributed.initialize(args)
        mesh_shape = check_mesh(cfg, jax.device_count(), jax.process_count())
        inputs = build.load_inputs(cfg, validation=True)
    except (ConfigError, CheckpointError, DistributedError, ValueError, KeyError, FileNotFoundError) as error:
        print(f"jppo.eval: error: {one_line(error)}", file=sys.stderr)
        return 2
    out = run_path(args.out or cfg.trainer.output_dir)
    try:
        report = evaluate(cfg, mesh_shape, inputs, out)
    except ConfigError as error:  # a checkpoint that does not match the config, or a limit only the data can break
        print(f"jppo.eval: error: {one_line(error)}", file=sys.stderr)
        return 2
    if distributed.is_main_process():
        summary = ", ".join(f"{k}={v:.4g}" for k, v in report["metrics"].items())
        print(f"jppo.eval: {report['checkpoint'] or 'config model'}: {summary}, output in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
