"""Multi-process start-up: one process per host (or per GPU) on JAX's own multi-controller runtime.

``initialize`` must run before anything touches a device. It picks, in order:

1. explicit flags ``--coordinator HOST:PORT --num-processes N --process-id I``;
2. the standard environment variables ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``;
3. a cluster JAX detects by itself (a Cloud TPU pod slice, a SLURM job), when ``--distributed auto`` is given or
   those environments are found;
4. otherwise a single process (nothing to do).

Under SLURM, JAX (0.10, ``jax._src.clusters.ClusterEnv``) makes each process see only the GPU numbered by its
``SLURM_LOCALID`` unless ``local_device_ids`` is given: right for one task per GPU, but one task per node would
drive one of its GPUs and the mesh would silently shrink. So jppo gives ``local_device_ids`` itself
(:func:`slurm_local_device_ids`): every GPU the process sees when it is its node's only task, its share of them
when several tasks see the same GPUs. ``--distributed dry-run`` prints what a process would start with (process
count and id, coordinator, local device ids, the mesh) and exits without connecting.

On CPU, processes talk through gloo collectives.

With an explicit coordinator, the processes first meet in a rendezvous of jppo's own, so that a wrong process id,
a missing process or an unreachable coordinator fails within ``--init-timeout`` seconds with one line that names
it, instead of hanging or the runtime aborting the process. The rendezvous needs a second TCP port on process 0's
host, besides JAX's coordinator port: by default ``PORT + 1`` of ``--coordinator HOST:PORT``, or
``--rendezvous-port``; every process must be able to reach it (open it in the firewall). ``--rendezvous off`` skips
the rendezvous: then only JAX's own ``--init-timeout`` applies, and a failed start-up may abort the process with
JAX's log and stack trace instead of one line.

The rendezvous protocol (TCP, one ASCII line each way): every process I > 0 connects to the rendezvous port and
sends ``jppo-rendezvous N I\\n``; process 0 keeps the valid connections open until all N - 1 have arrived and then
answers each ``ok\\n``; on a mismatching N, a duplicate I or its deadline it answers ``error <reason>\\n`` to all of
them, so that every process stops with the same line. A connection that sends nothing, part of a line or anything
else within ``HANDSHAKE_TIMEOUT`` seconds does not count: it is closed with a logged warning (why: ``_Gathering``).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import selectors
import socket
import time
from typing import Iterable, Mapping, Optional

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"

PROTOCOL = "jppo-rendezvous"
# Seconds a connection has to send its whole line; a real process sends it at once, right after connecting.
HANDSHAKE_TIMEOUT = 10.0
_MESSAGE = re.compile(rb"jppo-rendezvous (\d{1,9}) (\d{1,9})\n")
_MAX_MESSAGE = 64  # bytes: more than any valid line, so a longer one is garbage without waiting for its end
_MAX_REPLY = 1024

logger = logging.getLogger(__name__)


class DistributedError(RuntimeError):
    """A multi-process start-up problem, in one line."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("multi-process (one process per host)")
    group.add_argument("--coordinator", help=f"HOST:PORT of process 0 (default: ${ENV_COORDINATOR})")
    group.add_argument("--num-processes", type=int, help=f"number of processes (default: ${ENV_NUM_PROCESSES})")
    group.add_argument("--process-id", type=int, help=f"this process's index (default: ${ENV_PROCESS_ID})")
    group.add_argument("--distributed", choices=("auto", "off", "dry-run"), default=None,
                       help="auto: let JAX detect a TPU pod or SLURM job; off: single process; dry-run: print the "
                            "process count, local device ids and mesh this process would use, and exit")
    group.add_argument("--init-timeout", type=int, default=300, help="seconds to wait for all processes (300)")
    group.add_argument("--rendezvous", choices=("on", "off"), default="on",
                       help="on (default): with --coordinator, the processes first meet on the rendezvous port, so "
                            "that a missing, duplicate or misconfigured process fails within --init-timeout with one "
                            "line; off: skip it (no second port) and rely on JAX's own --init-timeout, whose failures "
                            "abort the process with a stack trace")
    group.add_argument("--rendezvous-port", type=int, metavar="PORT",
                       help="TCP port on process 0's host for the rendezvous, which every process must reach "
                            "(default: the --coordinator PORT + 1)")


# What JAX's SLURM detection needs (jax._src.clusters.slurm_cluster.SlurmCluster.is_env_present).
SLURM_VARIABLES = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")


def _visible_gpus(environ: Mapping[str, str]) -> Optional[int]:
    """GPUs this process can see: the entries of ``CUDA_VISIBLE_DEVICES`` (which SLURM sets for ``--gpus*``), else
    ``SLURM_GPUS_ON_NODE``; None when neither says (no GPUs to share out)."""
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        count = len([item for item in listed.split(",") if item.strip()])
    elif environ.get("SLURM_GPUS_ON_NODE", "").isdigit():
        count = int(environ["SLURM_GPUS_ON_NODE"])
    else:
        return None
    return count or None


def _tasks_on_this_node(environ: Mapping[str, str]) -> Optional[int]:
    """Tasks SLURM runs on this node: this node's entry of ``SLURM_STEP_TASKS_PER_NODE`` (or
    ``SLURM_TASKS_PER_NODE``), written like ``2(x3),1`` in node order (``SLURM_NODEID``), else
    ``SLURM_NTASKS_PER_NODE``."""
    spec = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    if spec:
        per_node = []
        for item in spec.split(","):
            match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
            if match is None:
                return None
            per_node += [int(match[1])] * int(match[2] or 1)
        node = int(environ.get("SLURM_NODEID", "0"))
        return per_node[node] if node < len(per_node) else None
    value = environ.get("SLURM_NTASKS_PER_NODE", "")
    return int(value) if value.isdigit() else None


def slurm_local_device_ids(environ: Mapping[str, str] = os.environ) -> Optional[list[int]]:
    """The GPUs (indices among those it sees) a SLURM task should drive, or None outside SLURM or without GPUs.

    With T tasks on the node and V visible GPUs: when V is a multiple of T, task ``SLURM_LOCALID`` = i takes the
    block ``[i V/T, (i + 1) V/T)``: all V for one task per node, GPU i for one task per GPU (JAX's own choice).
    When V < T, SLURM has bound each task to its own GPUs: all V."""
    if not all(name in environ for name in SLURM_VARIABLES):
        return None
    visible, tasks = _visible_gpus(environ), _tasks_on_this_node(environ)
    if visible is None or not tasks:
        return None
    if visible < tasks:
        return list(range(visible))
    if visible % tasks:
        raise DistributedError(
            f"SLURM runs {tasks} tasks on this node, which sees {visible} GPUs: run one task per node "
            "(--ntasks-per-node=1) or one per GPU"
        )
    local, per_task = int(environ["SLURM_LOCALID"]), visible // tasks
    return list(range(local * per_task, (local + 1) * per_task))


def _cluster_detected() -> bool:
    return "SLURM_JOB_ID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1 or (
        "TPU_WORKER_HOSTNAMES" in os.environ and "," in os.environ["TPU_WORKER_HOSTNAMES"]
    )


def settings(args: argparse.Namespace) -> Optional[dict]:
    """The ``jax.distributed.initialize`` arguments the flags and environment ask for (no ``coordinator_address``:
    JAX detects the cluster; ``None``: single process), with ``local_device_ids`` under SLURM
    (:func:`slurm_local_device_ids`). Checked before any connection is attempted."""
    kwargs = _process_settings(args)
    if kwargs is not None:
        given = os.environ.get("JAX_LOCAL_DEVICE_IDS")  # the user's own choice, which JAX would honour
        local_device_ids = [int(i) for i in given.split(",")] if given else slurm_local_device_ids()
        if local_device_ids is not None:
            kwargs["local_device_ids"] = local_device_ids
    return kwargs


def _process_settings(args: argparse.Namespace) -> Optional[dict]:
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
        host, _, port = coordinator.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise DistributedError(f"--coordinator={coordinator!r} must be HOST:PORT with a port in 1..65535")
        return {"coordinator_address": coordinator, "num_processes": num_processes, "process_id": process_id}
    if args.distributed in ("auto", "dry-run") or _cluster_detected():
        return {}
    return None


def rendezvous_port(args: argparse.Namespace) -> Optional[int]:
    """The TCP port on which the processes meet before JAX connects them, or None where they do not meet:
    ``--rendezvous off``, a single process, or a cluster JAX detects by itself (there is no coordinator to meet at)."""
    kwargs = settings(args)
    if args.rendezvous == "off" or not kwargs or "coordinator_address" not in kwargs:
        return None
    if args.rendezvous_port is not None:
        port, what = args.rendezvous_port, f"--rendezvous-port={args.rendezvous_port}"
    else:
        port = int(kwargs["coordinator_address"].rpartition(":")[2]) + 1
        what = f"the rendezvous port {port} (--coordinator port + 1; set --rendezvous-port)"
    if not 0 < port < 65536:
        raise DistributedError(f"{what} is not a TCP port in 1..65535")
    return port


def rendezvous(coordinator: str, num_processes: int, process_id: int, timeout: float, port: Optional[int] = None,
               handshake_timeout: float = HANDSHAKE_TIMEOUT) -> None:
    """All processes meet on ``port`` (default: the coordinator's port + 1) of the coordinator's host before JAX
    connects them (protocol in the module docstring): process 0 listens, the others retry until it does. Returns
    once process 0 has heard from every other process; raises :class:`DistributedError` with one line otherwise,
    within ``timeout`` seconds on every process."""
    host, _, coordinator_port = coordinator.rpartition(":")
    port = int(coordinator_port) + 1 if port is None else port
    if process_id == 0:
        with _listen(port) as server:
            _Gathering(server, num_processes, timeout, handshake_timeout).run()
    else:
        _join((host, port), num_processes, process_id, timeout)


def _message(num_processes: int, process_id: int) -> bytes:
    return f"{PROTOCOL} {num_processes} {process_id}\n".encode()


def _shown(data: bytes) -> str:
    """What a peer sent, quoted on one line and cut short: for warnings and errors."""
    return repr(bytes(data[:40])) + ("..." if len(data) > 40 else "") if data else "nothing"


def _listen(port: int) -> socket.socket:
    """Process 0's non-blocking listening socket on every interface, or one line saying why it cannot listen."""
    try:
        server = socket.create_server(("", port))
    except OSError as error:
        raise DistributedError(
            f"process 0 cannot listen on port {port} for the rendezvous ({error.strerror or error}): choose a free "
            "port with --rendezvous-port, or skip the rendezvous with --rendezvous off"
        ) from None
    server.setblocking(False)
    return server


class _Gathering:
    """Process 0's side of the rendezvous. Every socket is non-blocking and watched by one selector, so no single
    connection can hold it up: a connection must send its whole line within ``handshake_timeout`` and the whole
    gathering ends at the overall deadline.

    Only a valid, complete line counts as an arrival. A connection that sends nothing, part of a line or something
    else is closed and ignored with a warning rather than stopping the run: it is not a process of this job (a port
    scanner, a health check, another program), and a stray connection must not kill a job. A real process that sends
    garbage is still reported, as missing, at the deadline, and that error names the last connection ignored. A valid
    line that contradicts this job (another ``N``, a duplicate id) is a misconfiguration, reported at once."""

    def __init__(self, server: socket.socket, num_processes: int, timeout: float, handshake_timeout: float):
        self.server, self.num_processes = server, num_processes
        self.timeout, self.handshake_timeout = timeout, handshake_timeout
        self.port = server.getsockname()[1]
        self.deadline = time.monotonic() + timeout
        self.selector = selectors.DefaultSelector()
        self.selector.register(server, selectors.EVENT_READ)
        self.pending: dict[socket.socket, tuple[str, bytearray, float]] = {}  # peer, bytes so far, handshake deadline
        self.arrived: dict[int, tuple[socket.socket, str]] = {}  # process id -> its open connection, peer
        self.ignored: list[str] = []

    def run(self) -> None:
        """Waits until every other process has arrived, then answers them all ``ok``."""
        try:
            while len(self.arrived) < self.num_processes - 1:
                now = time.monotonic()
                if now >= self.deadline:
                    self._give_up()
                self._expire(now)
                wake = min([self.deadline, *(until for _, _, until in self.pending.values())])
                for key, _ in self.selector.select(max(wake - now, 0.0)):
                    self._on_readable(key.fileobj)
            logger.info("rendezvous: all %d processes arrived on port %d", self.num_processes, self.port)
            self._answer(b"ok\n")
        finally:
            self._close()

    def _on_readable(self, sock: socket.socket) -> None:
        if sock is self.server:
            self._accept()
        elif sock in self.pending:
            self._read(sock)
        else:
            self._check_arrived(sock)

    def _accept(self) -> None:
        try:
            connection, address = self.server.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):  # the peer left before we got to it
            return
        except OSError as error:
            self._fail(f"process 0 could not accept connections on the rendezvous port {self.port}: {error}")
        connection.setblocking(False)
        self.selector.register(connection, selectors.EVENT_READ)
        peer = f"{address[0]}:{address[1]}"
        self.pending[connection] = (peer, bytearray(), time.monotonic() + self.handshake_timeout)

    def _read(self, sock: socket.socket) -> None:
        """Adds what a new connection sent; once it ends a line (or hangs up, or sends too much), judges it."""
        peer, received, _ = self.pending[sock]
        try:
            data = sock.recv(_MAX_MESSAGE + 1 - len(received))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        received += data
        if data and b"\n" not in received and len(received) <= _MAX_MESSAGE:
            return
        match = _MESSAGE.fullmatch(bytes(received))
        if match is None:
            self._ignore(sock, f"{peer} sent {_shown(received)}, not a '{PROTOCOL} N I' line")
        else:
            self._arrive(sock, peer, int(match[1]), int(match[2]))

    def _arrive(self, sock: socket.socket, peer: str, num_processes: int, process_id: int) -> None:
        if num_processes != self.num_processes:
            self._fail(f"process {process_id} at {peer} was started with --num-processes={num_processes}, but "
                       f"process 0 with --num-processes={self.num_processes}: give every process the same", sock)
        if process_id == 0:
            self._fail(f"duplicate --process-id=0: {peer} claims it, but process 0 is the one listening on port "
                       f"{self.port}; give each process its own id", sock)
        if process_id >= num_processes:
            self._fail(f"{peer} sent --process-id={process_id}, not in [1, {num_processes})", sock)
        if process_id in self.arrived:
            self._fail(f"duplicate --process-id={process_id}: both {self.arrived[process_id][1]} and {peer} claim "
                       "it; give each process its own id", sock)
        del self.pending[sock]
        self.arrived[process_id] = (sock, peer)

    def _check_arrived(self, sock: socket.socket) -> None:
        """An arrived process's connection is readable only when it hangs up (it sends nothing more): it left, so
        it counts as missing again."""
        try:
            if sock.recv(_MAX_REPLY):
                return  # more than its line: ignored
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            pass
        process_id, peer = next((i, p) for i, (s, p) in self.arrived.items() if s is sock)
        logger.warning("rendezvous: process %d at %s left before every process arrived", process_id, peer)
        del self.arrived[process_id]
        self._drop(sock)

    def _expire(self, now: float) -> None:
        for sock, (peer, received, until) in list(self.pending.items()):
            if now >= until:
                self._ignore(sock, f"{peer} sent {_shown(received)} within {self.handshake_timeout:g} s")

    def _ignore(self, sock: socket.socket, what: str) -> None:
        logger.warning("rendezvous: ignored a connection that is not a jppo process of this job: %s", what)
        self.ignored.append(what)
        self.pending.pop(sock, None)
        self._drop(sock)

    def _give_up(self) -> None:
        missing = sorted(set(range(1, self.num_processes)) - set(self.arrived))
        stray = self.ignored + [f"{peer} sent {_shown(received)} so far" for peer, received, _ in self.pending.values()]
        line = (f"process 0 waited {self.timeout:g} s on port {self.port} (the rendezvous port: --coordinator port + 1 "
                f"unless --rendezvous-port), but processes {missing} of --num-processes={self.num_processes} never "
                "arrived")
        if stray:
            line += f"; ignored {len(stray)} other connection(s), the last: {stray[-1]}"
        self._fail(line)

    def _fail(self, line: str, also: Optional[socket.socket] = None) -> None:
        """Tells every arrived process (and ``also``, the one that caused it) why the rendezvous stopped, then
        raises that line here."""
        self._answer(f"error {line}\n".encode(), [] if also is None else [also])
        raise DistributedError(line)

    def _answer(self, reply: bytes, also: Iterable[socket.socket] = ()) -> None:
        for sock in [*(s for s, _ in self.arrived.values()), *also]:
            try:
                sock.send(reply)  # a short line into an idle socket's buffer: never blocks
            except OSError:
                pass  # that process is gone; it will not need the answer

    def _drop(self, sock: socket.socket) -> None:
        self.selector.unregister(sock)
        sock.close()

    def _close(self) -> None:
        for sock in [*self.pending, *(s for s, _ in self.arrived.values())]:
            self._drop(sock)
        self.selector.close()


def _join(address: tuple[str, int], num_processes: int, process_id: int, timeout: float) -> None:
    """A process I > 0's side of the rendezvous: retries until process 0 listens, then waits for its answer."""
    where = f"{address[0]}:{address[1]}"
    deadline = time.monotonic() + timeout
    problem = "no attempt"
    while time.monotonic() < deadline:
        try:
            reply = _ask(address, _message(num_processes, process_id), deadline)
        except OSError as error:
            problem = error.strerror or str(error) or type(error).__name__
        else:
            if reply is None:
                raise DistributedError(
                    f"process {process_id} reached the rendezvous at {where}, but process 0 did not confirm within "
                    f"{timeout:g} s that all {num_processes} processes arrived (see process 0's error)"
                )
            if reply == b"ok\n":
                return
            if reply.startswith(b"error "):
                reason = " ".join(reply[len(b"error "):].decode("utf-8", "replace").split())
                raise DistributedError(f"process 0 at {where} stopped the rendezvous: {reason}")
            problem = f"it answered {_shown(reply)}"
        time.sleep(max(min(0.2, deadline - time.monotonic()), 0.0))
    raise DistributedError(
        f"process {process_id} could not reach the coordinator's rendezvous port at {where} within {timeout:g} s "
        f"({problem}): is process 0 running there, and is that port open to this host? (set it with "
        "--rendezvous-port, or skip the rendezvous with --rendezvous off)"
    )


def _ask(address: tuple[str, int], message: bytes, deadline: float) -> Optional[bytes]:
    """Sends ``message`` to process 0 and returns its answer (``b""``: it hung up without one; None: it kept the
    connection open past ``deadline`` without answering). Raises ``OSError`` when the connection fails."""
    connect_timeout = max(min(1.0, deadline - time.monotonic()), 0.01)
    with socket.create_connection(address, timeout=connect_timeout) as connection:
        connection.sendall(message)
        reply = b""
        while b"\n" not in reply and len(reply) < _MAX_REPLY:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            connection.settimeout(remaining)
            try:
                data = connection.recv(_MAX_REPLY)
            except socket.timeout:
                return None
            if not data:
                break
            reply += data
        return reply


@dataclasses.dataclass(frozen=True)
class StartPlan:
    """What a process would start with (None: left to JAX's cluster detection, known only once it runs)."""

    num_processes: Optional[int]
    process_id: Optional[int]
    coordinator: Optional[str]
    local_device_ids: Optional[list[int]]

    @property
    def num_devices(self) -> Optional[int]:
        """Devices of the whole job, assuming every process drives as many as this one."""
        if self.num_processes is None or self.local_device_ids is None:
            return None
        return self.num_processes * len(self.local_device_ids)

    def describe(self) -> str:
        known = lambda value, what: what if value is None else str(value)  # noqa: E731
        jax_decides = "decided by JAX at start-up"
        ids = self.local_device_ids
        coordinator = "none (one process)" if self.num_processes == 1 else known(self.coordinator, jax_decides)
        return (f"processes: {known(self.num_processes, jax_decides)}; this process: "
                f"{known(self.process_id, jax_decides)}; coordinator: {coordinator}; "
                f"local device ids: {'all visible devices' if ids is None else ','.join(map(str, ids))}")


def start_plan(args: argparse.Namespace) -> StartPlan:
    """The :func:`settings` of this process, with what SLURM says of the rest (JAX reads the same variables)."""
    kwargs = settings(args)
    slurm = all(name in os.environ for name in SLURM_VARIABLES)
    if kwargs is None or (not kwargs and not slurm and not _cluster_detected()):  # one process
        return StartPlan(1, 0, None, None)
    from_slurm = lambda name: int(os.environ[name]) if slurm else None  # noqa: E731
    return StartPlan(
        kwargs.get("num_processes", from_slurm("SLURM_NTASKS")), kwargs.get("process_id", from_slurm("SLURM_PROCID")),
        kwargs.get("coordinator_address"), kwargs.get("local_device_ids"),
    )


def initialize(args: argparse.Namespace) -> None:
    """Starts the multi-controller runtime when the flags or environment ask for one (see the module docstring)."""
    kwargs = settings(args)
    if kwargs is None:
        return
    if args.distributed == "dry-run":
        raise DistributedError("--distributed dry-run only prints the start-up plan; it does not start processes")
    import jax

    port = rendezvous_port(args)
    if port is not None:
        rendezvous(kwargs["coordinator_address"], kwargs["num_processes"], kwargs["process_id"], args.init_timeout,
                   port=port)
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
