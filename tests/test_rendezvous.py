"""The rendezvous before ``jax.distributed.initialize``, on loopback: only a complete, valid message counts as an
arrival; silent, partial or garbage connections never block process 0 past its deadline and never count; a
mismatching ``--num-processes`` or a duplicate ``--process-id`` stops every process with one line; ``--rendezvous
off`` and ``--rendezvous-port`` decide whether and where the processes meet."""

from __future__ import annotations

import argparse
import logging
import socket
import threading
import time
from typing import Optional

import pytest

from jppo.parallel import distributed, rendezvous
from jppo.parallel.rendezvous import DistributedError

SLACK = 1.0  # seconds a timed-out rendezvous may take beyond its timeout on a busy machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def coordinator(port: int) -> str:
    """The --coordinator whose default rendezvous port (coordinator port + 1) is ``port``."""
    return f"127.0.0.1:{port - 1}"


class Running:
    """One rendezvous call in a daemon thread (so that a hanging call cannot hang the test run), with its outcome."""

    def __init__(self, *args, **kwargs):
        self.error: Optional[BaseException] = None
        self.elapsed = float("nan")
        self._start = time.monotonic()
        self._thread = threading.Thread(target=self._run, args=args, kwargs=kwargs, daemon=True)
        self._thread.start()

    def _run(self, *args, **kwargs) -> None:
        try:
            rendezvous.rendezvous(*args, **kwargs)
        except BaseException as error:  # kept for the test to inspect
            self.error = error
        self.elapsed = time.monotonic() - self._start

    def outcome(self, within: float) -> Optional[BaseException]:
        """The call's exception (None: it succeeded); fails the test if it is still running after ``within`` s."""
        self._thread.join(within)
        assert not self._thread.is_alive(), f"the rendezvous is still running after {within} s"
        return self.error


def connect(port: int, payload: bytes = b"") -> socket.socket:
    """A raw client on the rendezvous port (retrying while process 0 starts listening) that sends ``payload``."""
    deadline = time.monotonic() + 5
    while True:
        try:
            client = socket.create_connection(("127.0.0.1", port), timeout=1)
            break
        except OSError:
            assert time.monotonic() < deadline, f"nothing listens on port {port}"
            time.sleep(0.05)
    client.sendall(payload)
    return client


def one_line(error: BaseException) -> str:
    assert isinstance(error, DistributedError), repr(error)
    text = str(error)
    assert "\n" not in text, text
    return text


def test_processes_meet_and_all_return():
    port = free_port()
    zero = Running(coordinator(port), 3, 0, 10)
    others = [Running(coordinator(port), 3, i, 10) for i in (1, 2)]
    assert zero.outcome(5) is None and all(other.outcome(5) is None for other in others)


def test_silent_client_does_not_count_and_process_0_reports_the_missing_one_in_time():
    port = free_port()
    timeout = 2
    zero = Running(coordinator(port), 2, 0, timeout)
    silent = connect(port)  # connects, sends nothing, stays open
    try:
        error = zero.outcome(timeout + 5)
    finally:
        silent.close()
    assert "processes [1] of --num-processes=2 never arrived" in one_line(error)
    assert "sent nothing" in str(error)
    assert zero.elapsed < timeout + SLACK


def test_silent_client_does_not_hold_up_the_others():
    port = free_port()
    zero = Running(coordinator(port), 2, 0, 20)
    silent = connect(port)
    try:
        one = Running(coordinator(port), 2, 1, 20)
        assert zero.outcome(5) is None and one.outcome(5) is None
    finally:
        silent.close()


def test_silent_client_is_dropped_after_the_handshake_timeout(caplog):
    port = free_port()
    zero = Running(coordinator(port), 2, 0, 10, handshake_timeout=0.3)
    with caplog.at_level(logging.WARNING, logger="jppo.parallel.rendezvous"), connect(port) as silent:
        silent.settimeout(5)
        start = time.monotonic()
        assert silent.recv(64) == b""  # process 0 hung up on it
        assert time.monotonic() - start < 0.3 + SLACK
        assert Running(coordinator(port), 2, 1, 10).outcome(5) is None and zero.outcome(5) is None
    assert any("sent nothing" in record.getMessage() and "127.0.0.1:" in record.getMessage()
               for record in caplog.records), caplog.text


@pytest.mark.parametrize("payload,shown", [
    (b"GET / HTTP/1.0\r\n\r\n", "GET / HTTP/1.0"),
    (b"1\n", "b'1\\n'"),  # a bare process id
    (b"jppo-rendezvous 2 x\n", "jppo-rendezvous 2 x"),
    (b"x" * 500, "xxxxxxxx"),
])
def test_garbage_is_ignored_with_a_warning_and_named_when_time_runs_out(caplog, payload, shown):
    port = free_port()
    timeout = 1.5
    zero = Running(coordinator(port), 2, 0, timeout)
    with caplog.at_level(logging.WARNING, logger="jppo.parallel.rendezvous"), connect(port, payload):
        error = zero.outcome(timeout + 5)
    text = one_line(error)
    assert "processes [1] of --num-processes=2 never arrived" in text and shown in text and "127.0.0.1:" in text
    assert any(shown in record.getMessage() for record in caplog.records), caplog.text
    assert zero.elapsed < timeout + SLACK


def test_partial_message_does_not_count():
    port = free_port()
    timeout = 1.5
    zero = Running(coordinator(port), 2, 0, timeout)
    with connect(port, b"jppo-rendezvous 2 1"):  # no newline: incomplete, and the client stays silent
        error = zero.outcome(timeout + 5)
    assert "processes [1] of --num-processes=2 never arrived" in one_line(error) and "jppo-rendezvous 2 1" in str(error)
    assert zero.elapsed < timeout + SLACK


def test_process_that_leaves_before_the_others_arrive_counts_as_missing(caplog):
    port = free_port()
    timeout = 1.5
    zero = Running(coordinator(port), 3, 0, timeout)
    with caplog.at_level(logging.WARNING, logger="jppo.parallel.rendezvous"):
        with connect(port, b"jppo-rendezvous 3 1\n"):
            time.sleep(0.2)  # process 0 reads its line, then it hangs up
        two = Running(coordinator(port), 3, 2, 20)
        text = one_line(zero.outcome(timeout + 5))
    assert "processes [1] of --num-processes=3 never arrived" in text
    assert "processes [1] of --num-processes=3 never arrived" in one_line(two.outcome(5))  # told by process 0
    assert any("process 1 at 127.0.0.1:" in record.getMessage() and "left" in record.getMessage()
               for record in caplog.records), caplog.text


def test_garbage_does_not_stop_the_real_processes():
    port = free_port()
    zero = Running(coordinator(port), 2, 0, 20)
    with connect(port, b"\x16\x03\x01 hello\n"):
        assert Running(coordinator(port), 2, 1, 20).outcome(5) is None and zero.outcome(5) is None


def test_mismatching_num_processes_stops_both_ends_with_one_line():
    port = free_port()
    zero = Running(coordinator(port), 2, 0, 20)
    one = Running(coordinator(port), 3, 1, 20)
    for error in (zero.outcome(5), one.outcome(5)):
        text = one_line(error)
        assert "--num-processes=3" in text and "--num-processes=2" in text and "127.0.0.1:" in text


def test_duplicate_process_id_stops_every_process_naming_the_id():
    port = free_port()
    zero = Running(coordinator(port), 3, 0, 20)
    first = Running(coordinator(port), 3, 1, 20)
    second = Running(coordinator(port), 3, 1, 20)
    for error in (zero.outcome(5), first.outcome(5), second.outcome(5)):
        assert "duplicate --process-id=1" in one_line(error)
    assert zero.elapsed < 5


def test_duplicate_of_process_0_is_reported():
    port = free_port()
    zero = Running(coordinator(port), 2, 0, 20)
    with connect(port, b"jppo-rendezvous 2 0\n") as impostor:
        assert "duplicate --process-id=0" in one_line(zero.outcome(5))
        impostor.settimeout(5)
        assert impostor.recv(1024).startswith(b"error ")


def test_client_fails_in_time_when_process_0_never_confirms():
    with socket.create_server(("127.0.0.1", 0)) as mute:  # accepts (by the kernel's backlog) but never answers
        port = mute.getsockname()[1]
        timeout = 1
        one = Running(coordinator(port), 2, 1, timeout)
        error = one.outcome(timeout + 5)
    assert "did not confirm" in one_line(error) and f"127.0.0.1:{port}" in str(error)
    assert one.elapsed < timeout + SLACK


def test_client_reports_an_unreachable_rendezvous_port_in_time():
    port = free_port()
    one = Running(coordinator(port), 2, 1, 1)
    text = one_line(one.outcome(6))
    assert "could not reach" in text and f"127.0.0.1:{port}" in text and "--rendezvous off" in text
    assert one.elapsed < 1 + SLACK


def test_process_0_reports_a_busy_rendezvous_port():
    with socket.create_server(("", 0)) as busy:
        port = busy.getsockname()[1]
        text = one_line(Running(coordinator(port), 2, 0, 5).outcome(5))
    assert f"port {port}" in text and "--rendezvous-port" in text


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    distributed.add_arguments(parser)
    return parser.parse_args(argv)


EXPLICIT = ("--coordinator", "10.0.0.1:8476", "--num-processes", "2", "--process-id", "1")


def test_rendezvous_port_is_coordinator_port_plus_one_unless_set_or_off():
    assert distributed.rendezvous_port(parse(*EXPLICIT)) == 8477
    assert distributed.rendezvous_port(parse(*EXPLICIT, "--rendezvous-port", "9000")) == 9000
    assert distributed.rendezvous_port(parse(*EXPLICIT, "--rendezvous", "off")) is None
    assert distributed.rendezvous_port(parse(*EXPLICIT, "--rendezvous", "off", "--rendezvous-port", "9000")) is None
    assert distributed.rendezvous_port(parse("--distributed", "auto")) is None  # JAX finds the cluster itself
    assert distributed.rendezvous_port(parse()) is None  # single process
    with pytest.raises(DistributedError, match="--rendezvous-port=70000"):
        distributed.rendezvous_port(parse(*EXPLICIT, "--rendezvous-port", "70000"))
    with pytest.raises(DistributedError, match="--rendezvous-port"):
        distributed.rendezvous_port(parse("--coordinator", "h:65535", "--num-processes", "2", "--process-id", "1"))


def test_help_tells_about_the_port_and_the_switch():
    parser = argparse.ArgumentParser()
    distributed.add_arguments(parser)
    text = " ".join(parser.format_help().split())
    assert "--rendezvous {on,off}" in text and "--rendezvous-port" in text and "PORT + 1" in text
    assert "PORT + 1" in distributed.__doc__ and "--rendezvous off" in distributed.__doc__


@pytest.mark.parametrize("switch,expected", [("on", 8477), ("off", None)])
def test_initialize_meets_only_when_the_rendezvous_is_on(monkeypatch, switch, expected):
    import jax

    met, started = [], []
    monkeypatch.setattr(distributed, "rendezvous", lambda *args, **kwargs: met.append(kwargs.get("port")))
    monkeypatch.setattr(jax.config, "update", lambda *args: None)  # no gloo set-up in the test process
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: started.append(kwargs))
    distributed.initialize(parse(*EXPLICIT, "--rendezvous", switch, "--init-timeout", "7"))
    assert met == ([] if expected is None else [expected])
    assert started == [{"initialization_timeout": 7, "coordinator_address": "10.0.0.1:8476", "num_processes": 2,
                        "process_id": 1}]
