"""``python -m jppo.train --config configs/quickstart.yaml [key.sub=value ...]``: the PPO / GRPO training loop of
:mod:`jppo.run.loop`, on every device of every process the multi-process flags start. Exit status: 0 done, 2 a bad
input (one line), 75 (:data:`~jppo.parallel.preemption.PREEMPTED_EXIT`) stopped by SIGTERM or SIGUSR1 after a
checkpoint (run the same command again to continue)."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

import jax

from jppo import cli
from jppo.config import ConfigError, TrainConfig, check_mesh
from jppo.parallel import distributed
from jppo.parallel.preemption import Preempted, StopRequest
from jppo.run import build
from jppo.run.loop import run


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    return cli.parse_args(
        argv, "train", "Train a language model with PPO / GRPO / RLOO / REINFORCE++.",
        overrides="key.sub=value overrides, e.g. trainer.total_steps=10", processes=True,
    )


def dry_run(cfg: TrainConfig, args: argparse.Namespace) -> str:
    """``--distributed dry-run``: how this process would start and the mesh it would train on, without starting.
    A single process counts its own devices; several assume every process drives as many as this one."""
    start = distributed.process_start(args)
    devices = start.num_devices
    if devices is None and start.num_processes == 1 and start.local_device_ids is None:
        devices = jax.device_count()
    if devices is None:
        mesh = "mesh: decided once JAX has started (the device count is not known before)"
    else:
        shape = check_mesh(cfg, devices, start.num_processes)
        mesh = f"mesh (data, fsdp, tensor, sequence, expert): {shape} over {devices - cfg.rollout.devices} devices"
        if cfg.rollout.devices:
            mesh += f", the rollout on the other {cfg.rollout.devices} (rollout.devices)"
    return f"jppo.train: dry run: {start.describe()}; {mesh}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    cli.log_to_stderr()
    args = parse_args(argv)
    try:  # a signal from here on, start-up and the final export included, ends in the status that means "resume me"
        with StopRequest(immediate=True):
            return train(args)
    except Preempted as stop:  # the same command resumes from the last checkpoint
        return cli.preempted("train", stop)


def train(args: argparse.Namespace) -> int:
    try:
        cfg = cli.load_config(args, sft=False)
        if args.distributed == "dry-run":
            print(dry_run(cfg, args))
            return 0
        mesh_shape = cli.start("train", cfg, args)
        inputs = build.load_inputs(cfg)
    except cli.START_ERRORS as error:
        return cli.fail("train", error)
    try:
        final = run(cfg, mesh_shape, inputs)
    except ConfigError as error:  # a checkpoint that does not match the config, or a limit only the data can break
        return cli.fail("train", error)
    if not distributed.is_main_process():
        return 0
    summary = "".join(f", {k}={final[k]:.4g}" for k in ("reward/mean", "actor/pg_loss", "critic/vf_loss") if k in final)
    print(f"jppo.train: done: step {cfg.trainer.total_steps}{summary}, output in {cfg.trainer.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
