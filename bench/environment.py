"""What a benchmark ran on: processor, cores, accelerator, library versions, machine load; and torch's threads.

XLA's CPU backend runs its intra-op thread pool on every core the process may be scheduled on
(``os.sched_getaffinity``); :func:`match_torch_threads` gives torch the same number, so the PyTorch peers use the
same amount of hardware as jppo.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform

import jax

LIBRARIES = ("jax", "jaxlib", "flax", "optax", "numpy", "torch", "transformers")


def usable_cores() -> int:
    """Cores this process may run on: the size of XLA's CPU thread pool."""
    return len(os.sched_getaffinity(0))


def match_torch_threads() -> int:
    """Sets torch's intra-op threads to the cores JAX uses on CPU and returns that number."""
    import torch

    threads = usable_cores()
    torch.set_num_threads(threads)
    return threads


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def describe() -> dict:
    """Hardware, software and load of this machine, for the header of a results table."""
    device = jax.devices()[0]
    return {
        "cpu": cpu_model(),
        "cpu_cores": usable_cores(),
        "backend": jax.default_backend(),
        "device_kind": device.device_kind,
        "device_count": jax.device_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": {name: _version(name) for name in LIBRARIES},
        "load_average_1m": os.getloadavg()[0],
    }
