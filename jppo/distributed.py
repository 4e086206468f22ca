"""Multi-process start-up: one process per host (or per GPU) on JAX's own multi-controller runtime.

``initialize`` must run before anything touches a device. It picks, in order:

1. explicit flags ``--coordinator HOST:PORT --num-processes N --process-id I``;
2. the standard environment variables ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``;
3. a cluster JAX detects by itself (a Cloud TPU pod slice, a SLURM job with one task per process), when
   ``--distributed auto`` is given or those environments are found;
4. otherwise a single process (nothing to do).

On CPU, processes talk through gloo collectives. A wrong process id or an unreachable coordinator fails within
``--init-timeout`` seconds with one line, instead of hanging: with an explicit coordinator, the processes first
meet on the next port (``PORT + 1``) with a plain TCP handshake, so that a missing process is reported by name
rather than by the runtime aborting the process.
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from typing import Optional

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"


class DistributedError(RuntimeError):
    """A multi-process start-up problem, in one line."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("multi-process (one process per host)")
    group.add_argument("--coordinator", help=f"HOST:PORT of process 0 (default: ${ENV_COORDINATOR})")
    group.add_argument("--num-processes", type=int, help=f"number of processes (default: ${ENV_NUM_PROCESSES})")
    group.add_argument("--process-id", type=int, help=f"this process's index (default: ${ENV_PROCESS_ID})")
    group.add_argument("--distributed", choices=("auto", "off"), default=None,
                       help="auto: let JAX detect a TPU pod or SLURM job; off: single process")
    group.add_argument("--init-timeout", type=int, default=300, help="seconds to wait for all processes (300)")


def _cluster_detected() -> bool:
    return "SLURM_JOB_ID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1 or (
        "TPU_WORKER_HOSTNAMES" in os.environ and "," in os.environ["TPU_WORKER_HOSTNAMES"]
    )


def settings(args: argparse.Namespace) -> Optional[dict]:
    """The ``jax.distributed.initialize`` arguments the flags and environment ask for (``{}``: auto-detect;
    ``None``: single process). Checked before any connection is attempted."""
    if args.distributed == "off":
        return None
    coordinator = args.coordinator or os.environ.get(ENV_COORDINATOR)
    num_processes = args.num_processes if args.num_processes is not None else os.environ.get(ENV_NUM_PROCESSES)
    process_id = args.process_id if args.process_id is not None else os.environ.get(ENV_PROCESS_ID)
    explicit = [value is not None for value in (coordinator, num_processes, process_id)]
    if any(explicit):
        if not all(explicit):
            raise DistributedError(
                "give all three of --coordinator HOST:PORT, --num-processes N and --process-id I (or their "
                f"${ENV_COORDINATOR} / ${ENV_NUM_PROCESSES} / ${ENV_PROCESS_ID})"
            )
        try:
            num_processes, process_id = int(num_processes), int(process_id)
        except ValueError:
            raise DistributedError(f"--num-processes={num_processes!r} and --process-id={process_id!r} must be integers") from None
        if num_processes < 1:
            raise DistributedError(f"--num-processes={num_processes} must be >= 1")
        if not 0 <= process_id < num_processes:
            raise DistributedError(f"--process-id={process_id} must be in [0, {num_processes}) for --num-processes={num_processes}")
        if ":" not in coordinator:
            raise DistributedError(f"--coordinator={coordinator!r} must be HOST:PORT")
        return {"coordinator_address": coordinator, "num_processes": num_processes, "process_id": process_id}
    if args.distributed == "auto" or _cluster_detected():
        return {}
    return None


def rendezvous(coordinator: str, num_processes: int, process_id: int, timeout: float) -> None:
    """All processes meet on ``PORT + 1`` of the coordinator's host before JAX connects: process 0 waits for the
    others' ids, the others retry until process 0 listens. Raises :class:`DistributedError` on timeout."""
    host, port = coordinator.rsplit(":", 1)
    address = (host, int(port) + 1)
    deadline = time.monotonic() + timeout
    if process_id == 0:
        arrived = set()
        with socket.create_server(("", address[1]), reuse_port=False) as server:
            while len(arrived) < num_processes - 1:
                server.settimeout(max(deadline - time.monotonic(), 0.01))
                try:
                    connection, _ = server.accept()
                except (socket.timeout, TimeoutError):
                    missing = sorted(set(range(1, num_processes)) - arrived)
                    raise DistributedError(
                        f"process 0 waited {timeout:.0f} s at {host}:{address[1]} (--coordinator port + 1), but processes "
                        f"{missing} of --num-processes={num_processes} never arrived"
                    ) from None
                with connection:
                    arrived.add(int(connection.recv(16).decode() or -1))
        return
    while True:
        try:
            with socket.create_connection(address, timeout=1.0) as connection:
                connection.sendall(str(process_id).encode())
            return
        except OSError:
            if time.monotonic() > deadline:
                raise DistributedError(
                    f"process {process_id} could not reach the coordinator at {host}:{address[1]} (--coordinator "
                    f"{coordinator}, port + 1) within {timeout:.0f} s: is process 0 running there?"
                ) from None
            time.sleep(0.2)


def initialize(args: argparse.Namespace) -> None:
    """Starts the multi-controller runtime when the flags or environment ask for one (see the module docstring)."""
    kwargs = settings(args)
    if kwargs is None:
        return
    import jax

    if kwargs:
        rendezvous(kwargs["coordinator_address"], kwargs["num_processes"], kwargs["process_id"], args.init_timeout)
    # CPU devices need a collectives implementation across processes; accelerators use their own (NCCL, ICI).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(initialization_timeout=args.init_timeout, **kwargs)
    except Exception as error:  # connection failures surface as several exception types
        where = kwargs.get("coordinator_address", "auto-detected cluster")
        raise DistributedError(
            f"could not start process {kwargs.get('process_id', '?')} of {kwargs.get('num_processes', '?')} with "
            f"coordinator {where} within {args.init_timeout} s: {' '.join(str(error).split())[:300]}"
        ) from None


def is_main_process() -> bool:
    import jax

    return jax.process_index() == 0
