"""``python -m jppo.sft --config configs/quickstart_sft.yaml [key.sub=value ...]``: supervised fine-tuning
(:mod:`jppo.run.sft`) on every device of every process the multi-process flags start, with the RL update's engine,
normalizers, checkpoints and loggers. Exit status: 0 done, 2 a bad input (one line, before anything compiles: a
key, a file, a row of the data), 75 (:data:`~jppo.parallel.preemption.PREEMPTED_EXIT`) stopped by SIGTERM or SIGUSR1
after a checkpoint (run the same command again to continue)."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

import jax

from jppo import cli
from jppo.config import ConfigError
from jppo.parallel import distributed
from jppo.parallel.preemption import Preempted, StopRequest
from jppo.run import sft


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    return cli.parse_args(
        argv, "sft", "Supervised fine-tuning on prompt/completion or chat demonstrations.",
        overrides="key.sub=value overrides, e.g. trainer.total_steps=10 sft.train_files=data.jsonl", processes=True,
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    cli.log_to_stderr()
    args = parse_args(argv)
    try:  # a signal from here on, start-up and the final export included, ends in the status that means "resume me"
        with StopRequest(immediate=True):
            return fine_tune(args)
    except Preempted as stop:
        return cli.preempted("sft", stop)


def fine_tune(args: argparse.Namespace) -> int:
    try:
        cfg = cli.load_config(args, sft=True)
        inputs = sft.load_inputs(cfg)  # the rows' problems, before anything starts or compiles
        cli.start_processes("sft", cfg, args)  # the compilation cache and XLA's environment, logged; the processes
        shape = sft.mesh_shape(cfg, jax.device_count())
    except cli.START_ERRORS as error:
        return cli.fail("sft", error)
    try:
        final = sft.run(cfg, shape, inputs)
    except ConfigError as error:  # a checkpoint that does not match the config
        return cli.fail("sft", error)
    if distributed.is_main_process():
        summary = "".join(f", {k}={final[k]:.4g}" for k in ("sft/loss", "val/sft_nll") if k in final)
        print(f"jppo.sft: done: step {cfg.trainer.total_steps}{summary}, output in {cfg.trainer.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
