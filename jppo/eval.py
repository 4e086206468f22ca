"""``python -m jppo.eval --config CFG [key=value ...] [--out DIR]``: evaluation only, on the held-out prompts.

The policy (the config's model, or the checkpoint ``trainer.resume`` points at) is restored as a resumed run would
restore it (:mod:`jppo.run.loop`) and evaluated by the trainer's own held-out evaluation (:mod:`jppo.run.evaluate`,
which says what ``eval.json`` and ``generations.jsonl`` hold).
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

import jax

from jppo import cli
from jppo.config import ConfigError
from jppo.core.paths import run_path
from jppo.parallel import distributed
from jppo.run import build
from jppo.run.evaluate import evaluate_and_write
from jppo.run.lifecycle import read_resume
from jppo.run.loop import restore
from jppo.run.rollout_mesh import run_meshes


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    return cli.parse_args(
        argv, "eval", "Evaluate a policy (a model or a checkpoint) on the held-out prompts.",
        lambda parser: parser.add_argument("--out", help="output directory (default: trainer.output_dir)"),
        overrides="key.sub=value overrides, e.g. trainer.resume=runs/quickstart", processes=True,
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    cli.log_to_stderr()
    args = parse_args(argv)
    try:
        cfg = cli.load_config(args, sft=False)
        mesh_shape = cli.start("eval", cfg, args)
        inputs = build.load_inputs(cfg, evaluation=True)
    except cli.START_ERRORS as error:
        return cli.fail("eval", error)
    out = run_path(args.out or cfg.trainer.output_dir)
    try:
        # the run's meshes: with rollout.devices its samplers evaluate on the rollout's own devices, as in training
        mesh, rollout_mesh = run_meshes(jax.devices(), mesh_shape, cfg.rollout.devices)
        resume = read_resume(cfg, run_path(cfg.trainer.output_dir) / "checkpoints")  # a local folder or a gs:// URI
        state, collector, _, _, _ = restore(cfg, mesh, inputs, resume, rollout_mesh)
        report = evaluate_and_write(collector, state, resume.checkpoint, out)
    except ConfigError as error:  # a checkpoint that does not match the config, or a limit only the data can break
        return cli.fail("eval", error)
    if distributed.is_main_process():
        summary = ", ".join(f"{k}={v:.4g}" for k, v in report["metrics"].items())
        print(f"jppo.eval: {report['checkpoint'] or 'config model'}: {summary}, output in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
