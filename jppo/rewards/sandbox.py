"""A box for the model's code: a program run with the trainer's secrets, files, network and machine out of reach.

:func:`run_program` starts this file as a script (``python -I sandbox.py``: the standard library only, nothing of
the trainer imported), which boxes one run of the program:

- **namespaces of its own** (``unshare``): a mount namespace whose ``/tmp``, ``/var/tmp`` and ``/dev/shm`` are
  fresh size-limited tmpfs (the program's working directory is an empty ``/tmp/box``; all of it disappears with the
  box), a PID namespace whose first process is the program (when it ends or is killed, every process it started is
  killed with it) with its own ``/proc``, and, unless ``reward.code.network: allow``, a network namespace with no
  interface up (no socket reaches anything, 127.0.0.1 included);
- **an unprivileged user**: run as root (CI, containers) the program drops to ``nobody`` (65534), so that
  ``RLIMIT_NPROC`` holds (it does not bound root) and nothing owned by the trainer's user can be written or
  deleted; run as a user, the namespaces come from a user namespace and the process limit counts from that user's
  tasks at the start;
- **limits** (``setrlimit``): CPU seconds, address space, file size, open files, processes, no core dumps; a wall
  clock kills the box; stdout and stderr are read up to a size limit, past which the box is killed;
- **an empty environment** (not one of the trainer's variables), ``python -I`` (no ``PYTHON*`` variables, no user
  site, not the working directory's modules first).

Where the kernel refuses the namespaces (no root and no user namespaces), the box cannot isolate the network: the
run refuses to start with ``reward.kind: code`` unless ``reward.code.network: allow`` accepts that, in one line
(:func:`check_box`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 2, 4, 8, 16384, 1 << 18
NOBODY = 65534
BOX = "/tmp/box"
PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3")  # when the trainer's is out of reach


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one run of a program may use (``reward.code``'s settings)."""

    cpu_s: float = 5.0  # CPU seconds (RLIMIT_CPU)
    wall_s: float = 10.0  # wall-clock seconds before the box is killed
    memory_mb: int = 1024  # address space (RLIMIT_AS)
    file_mb: int = 16  # the largest file it may write (RLIMIT_FSIZE), and what /tmp holds in all (x4)
    open_files: int = 64  # RLIMIT_NOFILE
    processes: int = 32  # RLIMIT_NPROC: processes (threads included) of the box's user, beside what it had
    output_kb: int = 1024  # stdout and stderr, each; past it the box is killed


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How a run ended: ``exited`` (``exit_code``: its status; negative: the signal that killed it), ``timeout``
    (the wall clock), ``output_limit``, or ``unsupported`` (the box could not be built: ``stderr`` says why)."""

    status: str
    exit_code: Optional[int]
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.status == "exited" and self.exit_code == 0


def run_program(source: str, stdin: str = "", limits: Limits = Limits(), python: Optional[str] = None,
                network: str = "deny") -> Outcome:
    """Runs the Python program ``source`` in a box (module docstring) with ``stdin``; ``python``: the interpreter
    the box runs (default: :func:`box_python`)."""
    request = {"source": source, "stdin": stdin, "limits": dataclasses.asdict(limits),
               "python": python or box_python(network), "network": network}
    try:
        done = subprocess.run([sys.executable, "-I", os.path.abspath(__file__)], input=json.dumps(request),
                              capture_output=True, text=True, timeout=limits.wall_s + 30, env={})
    except subprocess.TimeoutExpired:  # the box's own clock failed it: never a hang of the trainer
        return Outcome("timeout", None, "", "the box did not end")
    try:
        reply = json.loads(done.stdout)
    except json.JSONDecodeError:
        return Outcome("unsupported", None, "", f"the box's launcher failed: {done.stderr.strip()[-300:]}")
    return Outcome(reply["status"], reply["exit_code"], reply["stdout"], reply["stderr"])


_PYTHON: dict[str, str] = {}


def box_python(network: str = "deny") -> str:
    """The first interpreter a box can run (the trainer's own may sit where ``nobody`` cannot read, as under
    ``/root``): the trainer's, then the system's."""
    if network not in _PYTHON:
        for candidate in (sys.executable, *PYTHONS):
            if os.path.exists(candidate):
                probe = run_program("print(6 * 7)", python=candidate, network=network,
                                    limits=Limits(cpu_s=10, wall_s=30))
                if probe.ok and probe.stdout.strip() == "42":
                    _PYTHON[network] = candidate
                    break
                if probe.status == "unsupported":
                    raise OSError(probe.stderr)
        else:
            raise OSError(f"no Python interpreter a box can run: tried {[sys.executable, *PYTHONS]}")
    return _PYTHON[network]


def check_box(network: str) -> None:
    """Raises ``OSError`` (why, in one line) when a box cannot be built here with ``network`` (``deny``: in a
    network namespace of its own)."""
    box_python(network)


# The launcher: what runs as ``python -I sandbox.py`` (below this line: the standard library only).


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)
    return libc


def _call(result: int, what: str) -> None:
    if result != 0:
        raise OSError(f"{what}: {os.strerror(ctypes.get_errno())}")


def _tasks_of(uid: int) -> int:
    """Tasks (threads included: what RLIMIT_NPROC counts) of ``uid`` now."""
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}").st_uid == uid:
                count += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            continue
    return count


def _box(request: dict) -> dict:
    limits, libc = request["limits"], _libc()
    uid, gid = os.getuid(), os.getgid()
    root = uid == 0
    processes = limits["processes"] if root else _tasks_of(uid) + limits["processes"]
    flags = CLONE_NEWNS | CLONE_NEWPID | (0 if request["network"] == "allow" else CLONE_NEWNET)
    boxed = libc.unshare(flags | (0 if root else CLONE_NEWUSER)) == 0
    if not boxed and request["network"] != "allow":
        raise OSError(f"unshare: {os.strerror(ctypes.get_errno())}")
    box = BOX
    if boxed:
        if not root:  # this user is root inside the user namespace, and no one else
            for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
        _call(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")
        size = f"size={4 * limits['file_mb']}m,mode=1777".encode()
        for where in ("/tmp", "/var/tmp", "/dev/shm"):
            if os.path.isdir(where):
                _call(libc.mount(b"tmpfs", where.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, size),
                      f"mount tmpfs {where}")
        os.mkdir(BOX, 0o700)
    else:  # reward.code.network: allow where the kernel refuses namespaces: limits and a user, no namespaces
        box = tempfile.mkdtemp(prefix="jppo-box-")
    try:
        for name, text in (("main.py", request["source"]), ("stdin.txt", request["stdin"])):
            with open(os.path.join(box, name), "w", encoding="utf-8") as f:
                f.write(text)
        if root:
            for name in ("", "main.py", "stdin.txt"):
                os.chown(os.path.join(box, name), NOBODY, NOBODY)
        return _run(request, libc, box, boxed, root, processes)
    finally:
        if not boxed:
            shutil.rmtree(box, ignore_errors=True)


def _run(request: dict, libc, box: str, boxed: bool, root: bool, processes: int) -> dict:
    limits = request["limits"]
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # boxed: the first process of the new PID namespace; it becomes the program
        try:
            if boxed:
                _call(libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None), "mount /proc")
            else:
                os.setsid()  # a process group of its own, killed whole
            os.chdir(box)
            cpu = max(1, int(limits["cpu_s"] + 0.999))
            for kind, value in ((resource.RLIMIT_CORE, 0), (resource.RLIMIT_AS, limits["memory_mb"] << 20),
                                (resource.RLIMIT_FSIZE, limits["file_mb"] << 20),
                                (resource.RLIMIT_NOFILE, limits["open_files"]), (resource.RLIMIT_NPROC, processes)):
                resource.setrlimit(kind, (value, value))
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
            if root:
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
            stdin = os.open("stdin.txt", os.O_RDONLY)
            for fd, target in ((stdin, 0), (out_w, 1), (err_w, 2)):
                os.dup2(fd, target)
            os.closerange(3, 1 << 16)
            os.execve(request["python"], [request["python"], "-I", "main.py"], {})
        except BaseException as error:  # noqa: BLE001 (the program never ran: said on its stderr, status 127)
            os.write(err_w, f"the box could not start the program: {error}".encode())
        os._exit(127)
    os.close(out_w)
    os.close(err_w)
    return _watch(pid, out_r, err_r, limits, boxed)


def _watch(pid: int, out_r: int, err_r: int, limits: dict, boxed: bool) -> dict:
    """Reads the program's output until it ends, the wall clock runs out or the output passes its limit."""
    cap, deadline, status = limits["output_kb"] << 10, time.monotonic() + limits["wall_s"], None
    outputs = {out_r: bytearray(), err_r: bytearray()}
    selector = selectors.DefaultSelector()
    for fd in outputs:
        selector.register(fd, selectors.EVENT_READ)
    while selector.get_map() and status is None:
        left = deadline - time.monotonic()
        if left <= 0:
            status = "timeout"
            break
        for key, _ in selector.select(timeout=left):
            chunk = os.read(key.fd, 1 << 16)
            if not chunk:
                selector.unregister(key.fd)
                continue
            outputs[key.fd] += chunk
            if len(outputs[key.fd]) > cap:
                status = "output_limit"
    if status is not None and boxed:
        os.kill(pid, signal.SIGKILL)  # the namespace's first process: every process of the box goes with it
    elif status is not None:
        os.killpg(pid, signal.SIGKILL)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    text = {fd: bytes(data[:cap]).decode("utf-8", "replace") for fd, data in outputs.items()}
    return {"status": status or "exited", "exit_code": None if status else code, "stdout": text[out_r],
            "stderr": text[err_r]}


def _launch() -> None:
    request = json.loads(sys.stdin.read())
    try:
        reply = _box(request)
    except OSError as error:
        reply = {"status": "unsupported", "exit_code": None, "stdout": "",
                 "stderr": f"this kernel refuses the box ({error})"}
    sys.stdout.write(json.dumps(reply))


if __name__ == "__main__":
    _launch()
