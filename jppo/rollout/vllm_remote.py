"""``rollout.engine: vllm`` on servers of its own (``rollout.vllm.num_servers`` started by the run on this host, or
``rollout.vllm.servers`` started by hand anywhere): the run's side of :mod:`jppo.rollout.vllm_server`.

Called like the in-process engine (:class:`~jppo.rollout.vllm_engine.VLLMSampler` samples through either), with
the same requests: token ids, one row per request with its own seed, every EOS a stop token, processed log-probs.

**Weights.** The run is rank 0 of a weight group with the servers (gloo on a CPU, NCCL on GPUs,
:mod:`jppo.rollout.weight_stream`). At start each server gets the policy's ``config.json`` and its weights by
stream and starts vLLM on them (a server already running this architecture reloads in place instead); after every
update :meth:`VLLMServers.push` streams the trained weights again, in buckets of ``rollout.vllm.bucket_bytes``, in
the rollout dtype, LoRA merged. On a GPU each parameter is gathered onto one device and handed to torch through
DLPack, never through host memory. The weights a server holds carry a policy version (the pushes so far); a
request names the version it needs and the server answers it with those weights only, so a run of several
processes (one pushes, all sample their own rows) never samples with stale weights.

**Failures.** Every call has ``rollout.vllm.timeout_s``: a server that does not join the group, take a push or
answer a request within it is an error naming the server (and, for a push, the bytes sent), never a hang. A
server that dies or stops answering while generating has its rows sent again: a server the run started is
restarted (and re-sent the current weights, the group re-formed); one started by hand is dropped and its rows go
to the others. The rows are the same requests with the same seeds, so no row is lost or sampled twice. A row vLLM
aborted (``finish_reason: abort``, e.g. a server paused) is requested again, never trained as a natural stop.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import json
import logging
import socket
import threading
import time
import uuid
import weakref
from typing import Optional, Sequence

import jax
import numpy as np
from flax import nnx

import jppo.rollout.vllm_worker as vllm_worker
import jppo.rollout.weight_stream as weight_stream
from jppo.core.errors import ConfigError
from jppo.models.hf import hf_tensors
from jppo.models.lora import merged
from jppo.parallel.hostlocal import gather_to_host
from jppo.rollout.params import SamplingParams
from jppo.rollout.vllm_server import LocalServer, ServerError, call, host_gpus, split_gpus

log = logging.getLogger("jppo.rollout.vllm_remote")

ABORT_RETRIES = 2  # a row aborted this many times more is an error (a server that keeps aborting is broken)
RECOVERIES = 2  # a generation whose servers fail this many times more is an error


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def own_address(toward: str) -> str:
    """This host's address as a server at ``toward`` (host:port) reaches it (the route the kernel would take)."""
    host = toward.rsplit(":", 1)[0]
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # no packet is sent: a UDP connect only picks the route
        return s.getsockname()[0]


def background(fn, *args) -> concurrent.futures.Future:
    """``fn(*args)`` on a daemon thread (an executor's threads would hold the process's exit until a request to a
    stalled server times out)."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as error:  # noqa: BLE001 (the caller's .result() raises it)
            future.set_exception(error)

    threading.Thread(target=run, name="jppo-vllm-call", daemon=True).start()
    return future


def engine_key(spec) -> str:
    """What a server's engine is started with: a server holding this key reloads in place instead of restarting."""
    return json.dumps([spec.model.to_hf("lm"), vllm_worker.llm_options(spec)], sort_keys=True, default=str)


def to_torch_on_gpu(array: jax.Array):
    """One parameter, gathered onto this process's first device, as a torch tensor on that GPU (DLPack)."""
    import torch  # noqa: PLC0415

    if not array.is_fully_addressable:  # shards on other hosts: gathered through the host, as the CPU path does
        return vllm_worker.as_torch(gather_to_host(array)).to("cuda")
    single = jax.device_put(array, jax.local_devices()[0]) if len(array.sharding.device_set) > 1 else array
    return torch.from_dlpack(single)


class VLLMServers:
    """The run's vLLM servers (see the module docstring): started or reached, fed the policy, asked for rows."""

    pushes_weights = True

    def __init__(self, spec, sampler_class):
        self._sampler_class = sampler_class  # vllm_engine.VLLMSampler: a sampler over either engine
        options = spec.options
        self.spec, self.timeout, self.bucket_bytes = spec, float(options.timeout_s), int(options.bucket_bytes)
        self.key = engine_key(spec)
        self.options = vllm_worker.llm_options(spec)
        self.gpu = jax.default_backend() == "gpu"
        self.backend, self.device = ("nccl", "cuda") if self.gpu else ("gloo", "cpu")
        self.main = jax.process_index() == 0
        self.local: list[Optional[LocalServer]] = []
        self._graphdef: Optional[nnx.GraphDef] = None
        self._pushed: list[weakref.ref] = []
        self._state = None
        self._group, self._groups = None, 0
        self.version = 0
        self.push_seconds, self.push_bytes, self.restarts, self.aborted_rows = 0.0, 0, 0, 0
        if not options.servers and jax.process_count() > 1:
            raise ConfigError(f"rollout.vllm.num_servers={options.num_servers} with {jax.process_count()} processes: "
                              "start the servers by hand (python -m jppo.serve) and list them in rollout.vllm.servers")
        atexit.register(self.close)  # the servers this run started end with it (and watch it: --exit-with)
        deadline = time.monotonic() + self.timeout
        if options.servers:
            self.addresses = list(options.servers)
            self.local = [None] * len(self.addresses)
        else:
            try:
                gpus, _ = split_gpus(options.num_servers, options.gpus, host_gpus())
                self.local = [LocalServer(i, gpus[i]) for i in range(options.num_servers)]
                self.addresses = [server.wait_address(deadline) for server in self.local]
            except ServerError as error:
                self.close()
                raise ConfigError(str(error)) from None
        try:
            for address, server in zip(self.addresses, self.local):
                self._wait_ready(address, server, deadline)
            if self.main:
                self._form_group()
                self._stream_all("/start", lambda: {"key": self.key, "config": spec.model.to_hf("lm"),
                                                     "options": self.options, "version": 0}, merged(spec.policy))
            else:  # process 0 starts them; this one waits until each holds this run's engine
                for address in self.addresses:
                    while call(address, "/info", None, self.timeout)["key"] != self.key:
                        if time.monotonic() > deadline:
                            raise ServerError(f"rollout.vllm server {address} did not start the policy in time")
                        time.sleep(0.5)
        except (ServerError, RuntimeError, weight_stream.StreamError) as error:
            self.close()
            raise ConfigError(f"rollout.engine='vllm' could not start its servers: {error}") from None

    # start-up and the weight group

    def _wait_ready(self, address: str, server: Optional[LocalServer], deadline: float) -> dict:
        while True:
            try:
                info = call(address, "/info", None, 10.0)
                vllm_worker.check_version(info["vllm"])
                return info
            except ServerError:
                if server is not None:
                    server.check_alive()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def _form_group(self) -> None:
        """A new weight group of this process (rank 0) and every server, replacing the last one."""
        self._groups += 1
        name = f"jppo-{uuid.uuid4().hex[:8]}-{self._groups}"
        host, port, world = own_address(self.addresses[0]), free_port(), len(self.addresses) + 1
        self._group = None
        joins = [background(call, address, "/join", {
            "host": host, "port": port, "rank": rank, "world": world, "backend": self.backend,
            "timeout_s": self.timeout, "name": name}, self.timeout + 30) for rank, address in
            enumerate(self.addresses, 1)]
        try:
            self._group = weight_stream.open_group(host, port, 0, world, self.backend, self.timeout, name)
        except weight_stream.StreamError as error:
            late = [a for a, j in zip(self.addresses, joins) if not j.done() or j.exception() is not None]
            raise weight_stream.StreamError(f"server(s) {', '.join(late) or '?'} did not join: {error}") from None
        for join in joins:
            join.result()

    def _stream_all(self, path: str, body, model) -> int:
        """``path`` asked of every server while this process streams ``model``'s weights to them; the bytes sent."""
        tensors = self._tensors(model)
        asked = [background(call, address, path, body(), self.timeout * 2 + 600) for address in self.addresses]
        try:
            sent = weight_stream.send(self._group, tensors, self.bucket_bytes, self.device)
        except weight_stream.StreamError as error:
            for server in self.local:  # a dead local server is what a failed stream usually means
                if server is not None and server.process.poll() is not None:
                    raise ServerError(f"rollout.vllm server {server.address}: exited while taking the weights "
                                      f"({server.tail()}); {error}") from None
            raise weight_stream.StreamError(
                f"the weight push to {', '.join(self.addresses)} did not finish within {self.timeout:g} s "
                f"(rollout.vllm.timeout_s): {error}") from None
        for answer in asked:
            answer.result()
        return sent

    def _tensors(self, model):
        """``model``'s Hugging Face tensors as torch tensors in the rollout dtype (a GPU's stay on the GPU)."""
        import torch  # noqa: PLC0415

        dtype = weight_stream.torch_dtype(str(self.spec.model.dtype))
        to_host = to_torch_on_gpu if self.gpu else (lambda a: vllm_worker.as_torch(gather_to_host(a)))
        for name, tensor in hf_tensors(model, to_host):
            yield name, (tensor.to(dtype) if torch.is_floating_point(tensor) else tensor)

    # the engine's interface (as VLLMEngine's)

    def sampler(self, graphdef: nnx.GraphDef, pad_id: int, mesh, params: SamplingParams, bucket: int):
        self._graphdef = graphdef
        return self._sampler_class(self, pad_id, mesh, params, bucket)

    def push(self, state: nnx.State) -> bool:
        """The policy's weights ``state`` to every server as the next policy version, unless these very arrays are
        the last pushed; returns whether it pushed (seconds and bytes in ``push_seconds``, ``push_bytes``)."""
        leaves = jax.tree.leaves(state)
        if vllm_worker.holds(self._pushed, leaves):
            return False
        start = time.perf_counter()
        model = merged(nnx.merge(self._graphdef, state))  # LoRA: W + s A B
        self.version += 1
        if self.main:
            self.push_bytes = self._with_recovery(
                lambda: self._stream_all("/weights", lambda: {"version": self.version}, model))
        else:
            for _ in self._tensors(model):  # the gathers are collective: every process takes part
                pass
        self._pushed, self._state = [weakref.ref(leaf) for leaf in leaves], state
        self.push_seconds = time.perf_counter() - start
        return True

    def _with_recovery(self, job):
        try:
            return job()
        except ServerError as error:
            self._recover(error, frozenset(server.address for server in self.local
                                           if server is not None and server.process.poll() is not None))
            return job()
        except weight_stream.StreamError as error:
            raise RuntimeError(str(error)) from None

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 seeds: Sequence[Optional[int]]) -> list[tuple[list[int], list[float]]]:
        """``(tokens, log-probs)`` of one response per prompt, the rows cut over the servers in order."""
        sampling = vllm_worker.sampling_request(params)
        rows: list[Optional[tuple]] = [None] * len(prompts)
        waiting = list(range(len(prompts)))
        for _ in range(ABORT_RETRIES + 1):
            for index, row in zip(waiting, self._generate_rows([prompts[i] for i in waiting], sampling,
                                                               [seeds[i] for i in waiting])):
                rows[index] = row
            waiting = [i for i in waiting if rows[i][2] == "abort"]
            if not waiting:
                break
            self.aborted_rows += len(waiting)
            log.warning("rollout.vllm: %d row(s) aborted by a server: requested again", len(waiting))
        else:
            raise RuntimeError(f"rollout.vllm: {len(waiting)} row(s) aborted {ABORT_RETRIES + 1} times")
        return [(tokens, log_probs) for tokens, log_probs, _ in rows]

    def _generate_rows(self, prompts, sampling: dict, seeds) -> list:
        for _ in range(RECOVERIES + 1):
            cuts = np.array_split(np.arange(len(prompts)), len(self.addresses))
            jobs = [background(call, address, "/generate", {
                "version": self.version, "timeout_s": self.timeout, "sampling": sampling,
                "prompts": [list(map(int, prompts[i])) for i in cut], "seeds": [seeds[i] for i in cut],
            }, self.timeout) for address, cut in zip(self.addresses, cuts)]
            concurrent.futures.wait(jobs)
            gone = {address for address, job in zip(self.addresses, jobs) if isinstance(job.exception(), ServerError)}
            if not gone:
                out: list = []
                for job in jobs:
                    out.extend(job.result()["rows"])  # another error: the server's one line
                return out
            # then every row again: each is the same request with the same seed
            self._recover(next(job.exception() for job in jobs if job.exception() is not None), gone)
        raise RuntimeError(f"rollout.vllm: the servers failed {RECOVERIES + 1} times in one generation")

    def _recover(self, error: ServerError, gone: frozenset = frozenset()) -> None:
        """After ``error``: each server that is gone (in ``gone``: it did not answer in time; or dead, or not
        answering ``/info``) restarted (ours) or dropped (one started by hand), the group re-formed and the current
        weights streamed to every server."""
        if jax.process_count() > 1:  # every process would have to re-gather the weights at once: resume instead
            raise RuntimeError(f"{error} (a run of several processes does not recover its servers: run the same "
                               "command again to resume from the last checkpoint)")
        log.warning("%s: recovering the rollout servers", error)
        alive = []
        for address, server in zip(self.addresses, self.local):
            if address not in gone and (server is None or server.process.poll() is None):
                try:
                    call(address, "/info", None, 10.0)
                    alive.append((address, server))
                    continue
                except ServerError:
                    pass
            if server is None:
                log.warning("rollout.vllm server %s is gone: its rows go to the others", address)
                continue
            server.stop()
            self.restarts += 1
            restarted = LocalServer(server.index, server.gpus)
            deadline = time.monotonic() + self.timeout
            address = restarted.wait_address(deadline)
            self._wait_ready(address, restarted, deadline)
            alive.append((address, restarted))
        if not alive:
            raise RuntimeError(f"{error}; no rollout server is left")
        self.addresses, self.local = [a for a, _ in alive], [s for _, s in alive]
        self._form_group()
        model = merged(nnx.merge(self._graphdef, self._state)) if self._state is not None else merged(
            self.spec.policy)
        self._stream_all("/start", lambda: {"key": self.key, "config": self.spec.model.to_hf("lm"),
                                            "options": self.options, "version": self.version}, model)

    def close(self) -> None:
        """Stops the servers this run started (servers started by hand keep running)."""
        for server in self.local:
            if server is not None:
                server.stop()
        self._group = None
