"""A vLLM rollout server: one ``vllm.LLM`` in a process of its own, on devices of its own, driven by a training run
over HTTP (JSON), its weights streamed in over a ``torch.distributed`` group (:mod:`jppo.rollout.weight_stream`).

Started by a run (``rollout.vllm.num_servers``, :mod:`jppo.rollout.vllm_remote`) or by hand on any host
(``python -m jppo.serve --host 0.0.0.0 --port 8000``, then ``rollout.vllm.servers: [host:8000]``): it starts with no
model; the run sends the policy's shape and options and streams its weights, and vLLM starts from them. The
server knows nothing of jppo's configs and runs nothing on JAX (the package's import loads it, unused; a server
the run starts has ``JAX_PLATFORMS=cpu``), so a GPU it shares with nothing stays vLLM's.

Endpoints (each body and answer a JSON object; an error is status 4xx/5xx with ``{"error": one line}``):

- ``GET /info``: ``vllm`` (version), ``key`` (what the running engine was started with, or null), ``version``
  (the policy version it holds, -1 before any), ``pid``.
- ``POST /join`` ``{host, port, rank, world, backend, timeout_s, name}``: joins the run's weight group (answers once
  every rank has joined). A later join replaces the group (a run re-forms it when a server is restarted).
- ``POST /start`` ``{key, config, options, version}``: takes the stream of the policy's weights; if the running
  engine was started with ``key``, reloads them in place, else writes them with ``config`` (``config.json``) to a
  temporary folder and starts vLLM on it with ``options`` (``LLM``'s keyword arguments), then removes the folder.
- ``POST /weights`` ``{version}``: takes the stream and reloads it in place; the engine then holds ``version``.
- ``POST /generate`` ``{version, prompts, sampling, seeds}``: waits (up to the request's ``timeout_s``) until the
  engine holds policy ``version`` (a run with several processes pushes from one of them and samples from all), then
  one response per prompt (:func:`jppo.rollout.vllm_worker.generate`): ``{"rows": [[tokens, log_probs, reason]]}``.

One request uses the engine at a time (a lock): generation, reloads and a start never overlap.
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from typing import Optional, Sequence

import jppo.rollout.vllm_worker as vllm_worker
import jppo.rollout.weight_stream as weight_stream
from jppo.core.errors import ConfigError


class Server:
    """The engine and the weight group of one server process, behind the HTTP handler."""

    def __init__(self, device: str = "cpu"):
        self.device = device  # where streamed buffers live: cpu (gloo) or cuda (nccl)
        self.llm = None
        self.key: Optional[str] = None
        self.version = -1
        self.group = None
        self.engine_lock = threading.Lock()
        self.changed = threading.Condition()

    def info(self, _: dict) -> dict:
        import vllm  # noqa: PLC0415

        return {"vllm": vllm.__version__, "key": self.key, "version": self.version, "pid": os.getpid()}

    def join(self, body: dict) -> dict:
        self.group = None  # a failed join leaves no half-formed group behind
        self.group = weight_stream.open_group(body["host"], int(body["port"]), int(body["rank"]), int(body["world"]),
                                              body["backend"], float(body["timeout_s"]), body["name"])
        return {"rank": body["rank"]}

    def _stream(self):
        if self.group is None:
            raise RuntimeError("this server has joined no weight group (POST /join first)")
        return weight_stream.receive(self.group, self.device)

    def start(self, body: dict) -> dict:
        started = time.perf_counter()
        with self.engine_lock:
            if self.llm is not None and self.key == body["key"]:
                vllm_worker.reload(self.llm, self._stream())
                fresh = False
            else:
                if self.llm is not None:
                    vllm_worker.shutdown(self.llm)
                    self.llm, self.key = None, None
                self.llm = self._start(body["config"], body["options"])
                self.key, fresh = body["key"], True
            self._hold(int(body["version"]))
        return {"started": fresh, "seconds": time.perf_counter() - started}

    def _start(self, config: dict, options: dict):
        from safetensors.torch import save_file  # noqa: PLC0415 (vLLM brings safetensors)

        folder = tempfile.mkdtemp(prefix="jppo-vllm-server-")
        try:
            with open(os.path.join(folder, "config.json"), "w") as f:
                json.dump(config, f)
            shard = 0
            tensors: dict = {}
            size = 0
            for name, tensor in self._stream():  # one bucket in memory at a time: written as it arrives
                tensors[name] = tensor.to("cpu").clone()
                size += tensors[name].numel() * tensors[name].element_size()
                if size >= 1 << 30:
                    save_file(tensors, os.path.join(folder, f"model-{shard:05d}.safetensors"))
                    tensors, size, shard = {}, 0, shard + 1
            if tensors:
                save_file(tensors, os.path.join(folder, f"model-{shard:05d}.safetensors"))
            return vllm_worker.start_llm(folder, options)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def weights(self, body: dict) -> dict:
        started = time.perf_counter()
        with self.engine_lock:
            if self.llm is None:
                raise RuntimeError("no engine started (POST /start first)")
            vllm_worker.reload(self.llm, self._stream())
            self._hold(int(body["version"]))
        return {"seconds": time.perf_counter() - started}

    def _hold(self, version: int) -> None:
        with self.changed:
            self.version = version
            self.changed.notify_all()

    def generate(self, body: dict) -> dict:
        version, timeout = int(body["version"]), float(body.get("timeout_s", 600))
        with self.changed:
            if not self.changed.wait_for(lambda: self.version >= version, timeout):
                raise TimeoutError(f"policy version {version} did not arrive within {timeout:g} s "
                                   f"(this server holds {self.version})")
        with self.engine_lock:
            if self.version != version:
                raise RuntimeError(f"asked for policy version {version}; this server holds {self.version}")
            rows = vllm_worker.generate(self.llm, body["prompts"], body["sampling"], body["seeds"])
        return {"rows": rows, "version": version}


# the run's side of the protocol: its requests, and the servers it starts on its own host

class ServerError(RuntimeError):
    """A server that died, stopped answering or could not be reached."""


def call(address: str, path: str, body: Optional[dict], timeout: float) -> dict:
    """One request to a server: its JSON answer, a :class:`ServerError` when it is unreachable or dead, a
    :class:`RuntimeError` with its one line when it answered with an error."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://{address}{path}", data=data, method="GET" if body is None else "POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return json.loads(answer.read())
    except urllib.error.HTTPError as error:
        try:
            said = json.loads(error.read()).get("error", "")
        except ValueError:
            said = error.reason
        raise RuntimeError(f"rollout.vllm server {address}: {path}: {said}") from None
    except (OSError, ValueError) as error:  # refused, reset, timed out, a half answer
        raise ServerError(f"rollout.vllm server {address}: {path}: {type(error).__name__}: {error}") from None


def host_gpus() -> list[str]:
    """The GPUs this process may use, as ``CUDA_VISIBLE_DEVICES`` names them: its entries when it is set, else the
    indices ``nvidia-smi`` lists; empty on a host without NVIDIA GPUs."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [gpu.strip() for gpu in visible.split(",") if gpu.strip()]
    try:
        listed = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                                text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return listed.stdout.split() if listed.returncode == 0 else []


def split_gpus(num_servers: int, gpus: Sequence[int], visible: Sequence[str]) -> tuple[list[list[str]], list[int]]:
    """The GPUs of the servers a run starts, and the trainer's: ``(each server's GPUs as CUDA_VISIBLE_DEVICES
    names them, the ordinals of ``visible`` the trainer keeps)``. Each server has one GPU: ``gpus``
    (``rollout.vllm.gpus``, ordinals of ``visible``) in order, or one of the last ``num_servers``. The trainer keeps
    the others: a GPU is vLLM's or JAX's, never both (each allocator takes most of a GPU's memory up front). No
    GPUs: the servers run on the CPU and the trainer keeps everything."""
    if not visible:
        return [[] for _ in range(num_servers)], []
    taken = list(gpus) or list(range(max(len(visible) - num_servers, 0), len(visible)))
    if any(not 0 <= gpu < len(visible) for gpu in taken) or len(set(taken)) != len(taken):
        raise ConfigError(f"rollout.vllm.gpus={list(gpus)}: distinct GPUs among this process's {len(visible)} "
                          f"(CUDA_VISIBLE_DEVICES: {','.join(visible)})")
    kept = [gpu for gpu in range(len(visible)) if gpu not in taken]
    if not kept:
        raise ConfigError(f"rollout.vllm.num_servers={num_servers} (rollout.devices) with gpus {taken} leaves the "
                          f"trainer none of this host's {len(visible)} GPUs: a GPU is the servers' or the trainer's")
    return [[visible[gpu]] for gpu in taken], kept


class LocalServer:
    """A server process this run started (``python -m jppo.serve`` on a free port of 127.0.0.1), its output in a
    log file whose tail a failure quotes."""

    def __init__(self, index: int, gpus: Sequence[str] = ()):
        self.index, self.gpus = index, tuple(gpus)
        self.folder = tempfile.mkdtemp(prefix=f"jppo-vllm-server{index}-")
        self.port_file = os.path.join(self.folder, "port")
        self.log_path = os.path.join(self.folder, "server.log")
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        if self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, self.gpus))
        with open(self.log_path, "ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "jppo.serve", "--port", "0", "--port-file", self.port_file,
                 "--exit-with", str(os.getpid())],
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.address: Optional[str] = None

    def wait_address(self, deadline: float) -> str:
        while not os.path.exists(self.port_file):
            self.check_alive()
            if time.monotonic() > deadline:
                raise ServerError(f"rollout.vllm server {self.index} did not listen in time ({self.tail()})")
            time.sleep(0.1)
        with open(self.port_file) as f:
            self.address = f"127.0.0.1:{int(f.read())}"
        return self.address

    def check_alive(self) -> None:
        if self.process.poll() is not None:
            raise ServerError(f"rollout.vllm server {self.index} exited with status {self.process.returncode} "
                              f"({self.tail()})")

    def tail(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                lines = [line for line in f.read().decode(errors="replace").splitlines() if line.strip()]
        except OSError:
            return "no log"
        return "its log ends: " + (lines[-1][:300] if lines else "(empty)")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


ROUTES = {("GET", "/info"): "info", ("POST", "/join"): "join", ("POST", "/start"): "start",
          ("POST", "/weights"): "weights", ("POST", "/generate"): "generate"}


def handler(server: Server):
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _answer(self, method: str) -> None:
            route = ROUTES.get((method, self.path))
            length = int(self.headers.get("Content-Length") or 0)
            try:
                body = json.loads(self.rfile.read(length) or b"{}")
                if route is None:
                    raise LookupError(f"no endpoint {method} {self.path}")
                status, answer = 200, getattr(server, route)(body)
            except Exception as error:  # noqa: BLE001 (every failure is the caller's one line)
                status = 404 if isinstance(error, LookupError) else 500
                answer = {"error": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"}
            data = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 (http.server's names)
            self._answer("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._answer("POST")

        def log_message(self, *args) -> None:  # requests are not news
            pass

    return Handler


def exit_with(pid: int) -> None:
    """Ends this process once process ``pid`` (the run that started it) is gone, however it ended (a SIGKILL
    included): a server a run started never outlives it."""
    def watch() -> None:
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                os._exit(0)
            except PermissionError:
                pass
            time.sleep(1.0)

    threading.Thread(target=watch, name="jppo-exit-with", daemon=True).start()


def serve(host: str, port: int, port_file: Optional[str] = None, device: str = "cpu") -> None:
    """Serves until killed; ``port`` 0 takes a free port, written (when it listens) to ``port_file``."""
    if device == "cpu":  # a libtpu installed beside (jax's TPU compiler) would make vLLM see two platforms
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    httpd = http.server.ThreadingHTTPServer((host, port), handler(Server(device)))
    httpd.daemon_threads = True
    if port_file:
        temporary = port_file + ".tmp"
        with open(temporary, "w") as f:
            f.write(str(httpd.server_address[1]))
        os.replace(temporary, port_file)  # the reader never sees half a number
    print(f"jppo.serve: vLLM {host}:{httpd.server_address[1]} (pid {os.getpid()})", file=sys.stderr, flush=True)
    httpd.serve_forever()


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m jppo.serve", description=(
        "A vLLM rollout server for jppo runs (rollout.vllm.servers: [host:port]): the run sends the policy and "
        "streams its weights; vLLM runs on this process's devices (CUDA_VISIBLE_DEVICES on a GPU node)."))
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000, help="port (0: a free one, see --port-file)")
    parser.add_argument("--port-file", default=None, help="write the port here once listening")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="where the weight stream lands: cuda (NCCL) on a GPU, cpu (gloo); default: cuda if torch "
                             "sees a GPU")
    parser.add_argument("--exit-with", type=int, default=None, metavar="PID",
                        help="end when process PID ends (a run that starts its servers passes its own)")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.exit_with:
        exit_with(args.exit_with)
    device = args.device
    if device is None:
        import torch  # noqa: PLC0415

        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        serve(args.host, args.port, args.port_file, device)
    except OSError as error:  # the port taken, an address not of this host
        print(f"jppo.serve: error: cannot listen on {args.host}:{args.port}: {error.strerror or error}",
              file=sys.stderr)
        return 2
    return 0
