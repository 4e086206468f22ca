"""Multi-process start-up: one process per host (or per GPU) on JAX's own multi-controller runtime.

``initialize`` must run before anything touches a device. It picks, in order:

1. explicit flags ``--coordinator HOST:PORT --num-processes N --process-id I``;
2. the standard environment variables ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``;
3. a cluster JAX detects by itself (a Cloud TPU pod slice, a SLURM job), when ``--distributed auto`` is given or
   those environments are found: SLURM's variables, GKE's ``TPU_WORKER_HOSTNAMES``, or, on a GCE TPU VM (where no
   variable names the pod: JAX asks the VM's metadata server), a slice of more than one worker in the metadata
   server's ``worker-network-endpoints`` (:func:`gce_tpu_workers`, what ``jax._src.clusters.GceTpuCluster`` reads);
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
JAX's log and stack trace instead of one line. The protocol: :mod:`jppo.parallel.rendezvous`.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import re
import urllib.request
from typing import Mapping, Optional

from jppo.parallel.rendezvous import DistributedError, rendezvous

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"


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


# A TPU chip on the PCI bus: Google's vendor id with one of the TPU device ids (v3, v4, v5p, v5e, v6e, 7x; as
# jax._src.hardware_utils lists them). Google's vendor id alone is not enough: a GCE VM's gVNIC network card has it.
GOOGLE_PCI_VENDOR = "0x1ae0"
TPU_PCI_DEVICES = frozenset({"0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076"})
PCI_DEVICES = "/sys/bus/pci/devices"
# Seconds to wait for the metadata server, which answers within milliseconds on a VM and does not exist elsewhere.
METADATA_TIMEOUT = 2.0


def tpu_chips(pci_devices: Optional[str] = None) -> int:
    """TPU chips attached to this machine (0 off a TPU VM), counted on the PCI bus (``PCI_DEVICES``) as JAX counts
    them."""
    chips = 0
    pci_devices = PCI_DEVICES if pci_devices is None else pci_devices
    for vendor in glob.glob(os.path.join(pci_devices, "*", "vendor")):
        device = os.path.join(os.path.dirname(vendor), "device")
        try:
            with open(vendor) as v, open(device) as d:
                chips += v.read().strip() == GOOGLE_PCI_VENDOR and d.read().strip() in TPU_PCI_DEVICES
        except OSError:
            continue
    return chips


def gce_metadata(key: str, environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """The TPU VM's instance attribute ``key`` from the GCE metadata server (``$GCE_METADATA_IP``, as JAX reads it),
    or None when no server answers within ``METADATA_TIMEOUT`` seconds."""
    host = environ.get("GCE_METADATA_IP", "metadata.google.internal")
    request = urllib.request.Request(f"http://{host}/computeMetadata/v1/instance/attributes/{key}",
                                     headers={"Metadata-Flavor": "Google"})
    try:
        with urllib.request.urlopen(request, timeout=METADATA_TIMEOUT) as response:
            return response.read().decode()
    except (OSError, ValueError):
        return None


def gce_tpu_workers(environ: Mapping[str, str] = os.environ, on_tpu_vm: Optional[bool] = None
                    ) -> Optional[tuple[list[str], int]]:
    """(the workers of this GCE TPU VM's slice, this worker's index) from the metadata server, as JAX's
    ``GceTpuCluster`` finds them; None off a TPU VM (no TPU chip on the PCI bus, or ``TPU_SKIP_MDS_QUERY`` set, which
    JAX sets where it found no chip) or when the server does not say. ``worker-network-endpoints`` is a list of
    hostnames or of ``name:id:ip`` triples, in worker order."""
    if on_tpu_vm is None:
        on_tpu_vm = tpu_chips() > 0
    if not on_tpu_vm or "TPU_SKIP_MDS_QUERY" in environ:
        return None
    endpoints, worker = gce_metadata("worker-network-endpoints", environ), gce_metadata("agent-worker-number", environ)
    if not endpoints or worker is None or not worker.strip().isdigit():
        return None
    return [item.split(":")[-1] for item in endpoints.strip().split(",")], int(worker)


def _cluster_detected(environ: Mapping[str, str] = os.environ) -> bool:
    """A multi-process cluster JAX would join by itself: a SLURM job of several tasks, a GKE TPU slice of several
    hosts, or a GCE TPU VM slice of several workers."""
    if "SLURM_JOB_ID" in environ and int(environ.get("SLURM_NTASKS", "1")) > 1:
        return True
    hosts = environ.get("TPU_PROCESS_ADDRESSES") or environ.get("TPU_WORKER_HOSTNAMES")
    if hosts is not None:
        return "," in hosts
    workers = gce_tpu_workers(environ)
    return workers is not None and len(workers[0]) > 1


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
            raise DistributedError(
                f"--num-processes={num_processes!r} and --process-id={process_id!r} must be integers"
            ) from None
        if num_processes < 1:
            raise DistributedError(f"--num-processes={num_processes} must be >= 1")
        if not 0 <= process_id < num_processes:
            raise DistributedError(
                f"--process-id={process_id} must be in [0, {num_processes}) for --num-processes={num_processes}"
            )
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


@dataclasses.dataclass(frozen=True)
class ProcessStart:
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


def process_start(args: argparse.Namespace) -> ProcessStart:
    """The :func:`settings` of this process, with what SLURM or a GCE TPU VM's metadata server says of the rest
    (JAX reads the same)."""
    kwargs = settings(args)
    slurm = all(name in os.environ for name in SLURM_VARIABLES)
    if kwargs is None or (not kwargs and not slurm and not _cluster_detected()):  # one process
        return ProcessStart(1, 0, None, None)
    if slurm:
        count, index = int(os.environ["SLURM_NTASKS"]), int(os.environ["SLURM_PROCID"])
    else:
        tpu = None if "coordinator_address" in kwargs else gce_tpu_workers()
        count, index = (len(tpu[0]), tpu[1]) if tpu else (None, None)
    return ProcessStart(
        kwargs.get("num_processes", count), kwargs.get("process_id", index), kwargs.get("coordinator_address"),
        kwargs.get("local_device_ids"),
    )


def initialize(args: argparse.Namespace) -> None:
    """Starts the multi-controller runtime when the flags or environment ask for one (see the module docstring)."""
    kwargs = settings(args)
    if kwargs is None:
        return
    if args.distributed == "dry-run":
        raise DistributedError("--distributed dry-run only prints the start-up plan; it does not start processes")
    import jax  # noqa: PLC0415 (the commands' --help and dry run start no jax)

    port = rendezvous_port(args)
    if port is not None:
        rendezvous(kwargs["coordinator_address"], kwargs["num_processes"], kwargs["process_id"], args.init_timeout,
                   port=port)
    # CPU devices need a collectives implementation across processes; accelerators use their own (NCCL, ICI).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(initialization_timeout=args.init_timeout, **kwargs)
    except Exception as error:  # noqa: BLE001 (connection failures surface as several exception types)
        where = kwargs.get("coordinator_address", "auto-detected cluster")
        raise DistributedError(
            f"could not start process {kwargs.get('process_id', '?')} of {kwargs.get('num_processes', '?')} with "
            f"coordinator {where} within {args.init_timeout} s: {' '.join(str(error).split())[:300]}"
        ) from None
    from jppo.parallel.preemption import StopRequest  # noqa: PLC0415 (imports JAX)

    if StopRequest.active is not None:  # the client's preemption notifier took SIGTERM: the command takes it back
        StopRequest.active.reinstall()


def is_main_process() -> bool:
    import jax  # noqa: PLC0415 (the commands' --help and dry run start no jax)

    return jax.process_index() == 0
