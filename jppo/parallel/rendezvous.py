"""The rendezvous of a run's processes before JAX connects them: a wrong process id, a missing process or an
unreachable coordinator fails within ``--init-timeout`` seconds with one line that names it
(:func:`jppo.parallel.distributed.initialize` calls :func:`rendezvous` when there is an explicit coordinator).

The rendezvous protocol (TCP, one ASCII line each way): every process I > 0 connects to the rendezvous port and
sends ``jppo-rendezvous N I\\n``; process 0 keeps the valid connections open until all N - 1 have arrived and then
answers each ``ok\\n``; on a mismatching N, a duplicate I or its deadline it answers ``error <reason>\\n`` to all of
them, so that every process stops with the same line. A connection that sends nothing, part of a line or anything
else within ``HANDSHAKE_TIMEOUT`` seconds does not count: it is closed with a logged warning (why: ``_Gathering``).
"""

from __future__ import annotations

import logging
import re
import selectors
import socket
import time
from typing import Iterable, Optional

PROTOCOL = "jppo-rendezvous"
# Seconds a connection has to send its whole line; a real process sends it at once, right after connecting.
HANDSHAKE_TIMEOUT = 10.0
_MESSAGE = re.compile(rb"jppo-rendezvous (\d{1,9}) (\d{1,9})\n")
_MAX_MESSAGE = 64  # bytes: more than any valid line, so a longer one is garbage without waiting for its end
_MAX_REPLY = 1024

logger = logging.getLogger(__name__)


class DistributedError(RuntimeError):
    """A multi-process start-up problem, in one line."""


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
