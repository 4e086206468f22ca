"""The commands' shared plumbing (``python -m jppo.train|eval|audit|export|plan|plot``).

A command parses its arguments with :func:`parse_args` (``--config`` and ``key.sub=value`` overrides for a command
that reads a config, the multi-process flags for one that starts processes), reads its config with
:func:`load_config`, and calls the library. What the user's input can break (a key, a file, a checkpoint, a flag)
ends the command with one line on stderr, ``jppo.<command>: error: <message>``, and exit status 2 (:func:`fail`):
no traceback. A traceback is left to what is a bug.

This module is imported by every command, ``python -m jppo.plot`` too, whose ``--help`` needs neither JAX nor the
config: what they need is imported where it is used.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING, Callable, Optional, Sequence, TypeVar

from jppo.core.errors import one_line
from jppo.parallel import distributed

if TYPE_CHECKING:
    from jppo.parallel.preemption import Preempted

# What a user's input raises: a bad setting (ConfigError, CheckpointError, ExportError and InvalidSetting are
# ValueErrors), a missing key or file.
INPUT_ERRORS = (ValueError, KeyError, FileNotFoundError)
# ... and, for a command that starts processes, a process that cannot join the others
START_ERRORS = (*INPUT_ERRORS, distributed.DistributedError)
# The environment that tunes XLA and the TPU runtime, logged when a command starts (tpu_scripts/xla_flags.sh)
XLA_ENVIRONMENT = ("XLA_FLAGS", "LIBTPU_INIT_ARGS", "XLA_PYTHON_CLIENT_MEM_FRACTION")
T = TypeVar("T")


def parse_args(
    argv: Optional[Sequence[str]], command: str, description: str,
    options: Optional[Callable[[argparse.ArgumentParser], None]] = None, *, overrides: Optional[str] = None,
    processes: bool = False,
) -> argparse.Namespace:
    """The arguments of ``python -m jppo.<command>``: ``--config`` (when the command takes ``overrides``, their
    help), the command's own ``options``, the positional ``overrides``, and the multi-process flags of
    :func:`jppo.parallel.distributed.add_arguments` (``processes``). Positionals and flags may come in any order."""
    parser = argparse.ArgumentParser(prog=f"python -m jppo.{command}", description=description)
    if overrides is not None:
        from jppo.config import CONFIG_HELP  # noqa: PLC0415 (plot's --help reads no config)

        parser.add_argument("--config", help=CONFIG_HELP)
    if options is not None:
        options(parser)
    if overrides is not None:
        parser.add_argument("overrides", nargs="*", help=overrides)
    if processes:
        distributed.add_arguments(parser)
    # Intermixed: the overrides may sit on either side of a flag (`--config C $ARGS --devices 8 mesh.fsdp=8`), where
    # plain parsing takes the first run of positionals only and refuses the rest as unrecognized.
    return parser.parse_intermixed_args(argv)


def load_config(args: argparse.Namespace, data_files: bool = True, sft: Optional[bool] = None):
    """The checked, frozen config of ``--config`` and the overrides: the config layer's checks and every
    component's (:mod:`jppo.run.checks` registers them), before anything compiles (``data_files`` False:
    the prompt files are not read, for what needs only shapes: compiling for a target; ``sft``: checked as an SFT
    run's, True, or an RL run's, False; None: as the config says, :func:`jppo.config.applies.sets_sft`)."""
    import jppo.run.checks  # noqa: F401, PLC0415 (registers the components' checks; plot's --help needs none)
    from jppo.config import load_config as load  # noqa: PLC0415 (plot's --help reads no config)

    return load(args.config, args.overrides, data_files, sft)


def log_to_stderr() -> None:
    """INFO messages of jppo's loggers on stderr, ``LEVEL name: message`` (the commands that train or evaluate).
    The level is set on jppo's own logger: a library imported before may have configured the root logger already
    (a module-level ``logging.warning`` does, at WARNING), and then ``basicConfig`` alone changes nothing."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("jppo").setLevel(logging.INFO)


def keep_trainer_gpus(cfg) -> None:
    """With vLLM servers this run starts on a GPU node (``rollout.devices`` or ``rollout.vllm.num_servers``), JAX
    in this process uses only the GPUs the servers do not take (:func:`jppo.rollout.vllm_server.split_gpus`): each
    allocator takes most of a GPU up front. Called before JAX starts its backend; nothing to do on a CPU."""
    vllm = cfg.rollout.vllm
    if cfg.rollout.engine != "vllm" or not vllm.num_servers:
        return
    import jax  # noqa: PLC0415

    from jppo.rollout.vllm_server import host_gpus, split_gpus  # noqa: PLC0415

    visible = host_gpus()
    if visible:
        _, kept = split_gpus(vllm.num_servers, vllm.gpus, visible)
        jax.config.update("jax_cuda_visible_devices", ",".join(map(str, kept)))


def start_processes(command: str, cfg, args: argparse.Namespace, check: Callable[[], T] = lambda: None) -> T:
    """What a command that runs the models does before anything compiles: the persistent compilation cache
    (``trainer.compilation_cache``); the processes (the multi-process flags); ``check()``, whose value is returned;
    then the cache and the XLA environment, logged."""
    from jppo.parallel import compile_cache  # noqa: PLC0415

    log = logging.getLogger(f"jppo.{command}")
    cache = compile_cache.apply(cfg.trainer.compilation_cache)  # before anything compiles
    keep_trainer_gpus(cfg)  # before JAX starts its backend
    distributed.initialize(args)
    checked = check()  # a start-up that fails says so in its one line, and nothing else: logged after
    log.info("compilation cache: %s", cache or "off")
    for name in XLA_ENVIRONMENT:  # what the launch scripts' tpu_scripts/xla_flags.sh set, or the user did
        log.info("%s=%s", name, os.environ.get(name, "(unset)"))
    return checked


def start(command: str, cfg, args: argparse.Namespace) -> tuple[int, int, int, int]:
    """:func:`start_processes`, then the mesh shape the config asks for on every device of every process."""
    import jax  # noqa: PLC0415 (plot's --help needs no JAX)

    from jppo.config import check_mesh  # noqa: PLC0415

    def checked() -> tuple[int, int, int, int]:
        shape = check_mesh(cfg, jax.device_count(), jax.process_count())
        if cfg.rollout.devices:  # a device that cannot hold the sampler: refused before anything compiles
            from jppo.preflight.split_memory import check_rollout_fits  # noqa: PLC0415

            # this process's own last device (a rollout device): JAX keeps no memory stats of another process's
            check_rollout_fits(cfg, (jax.local_devices()[-1].memory_stats() or {}).get("bytes_limit"))
        return shape

    return start_processes(command, cfg, args, checked)


def preempted(command: str, stop: Preempted) -> int:
    """A run stopped by a signal: later signals ignored on the way out (srun ending the step must not change the
    status), one line on stderr, and the status the launch scripts re-queue
    (:data:`~jppo.parallel.preemption.PREEMPTED_EXIT`)."""
    import signal  # noqa: PLC0415 (only a stopped run's way out)

    from jppo.parallel.preemption import PREEMPTED_EXIT, SIGNALS  # noqa: PLC0415 (JAX: not for --help)

    for number in SIGNALS:
        signal.signal(number, signal.SIG_IGN)
    print(f"jppo.{command}: {stop}; the same command resumes (exit status {PREEMPTED_EXIT})", file=sys.stderr)
    return PREEMPTED_EXIT


def fail(command: str, error: BaseException) -> int:
    """``error`` as the command's one-line message on stderr; the exit status 2."""
    print(f"jppo.{command}: error: {one_line(error)}", file=sys.stderr)
    return 2
