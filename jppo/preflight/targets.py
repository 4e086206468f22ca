"""The machines ``python -m jppo.plan --compile-for TARGET`` compiles for, as JAX's compile-only devices: the
accelerators' own compilers run on this host, with no accelerator present.

A TARGET is a TPU slice as libtpu names its topologies (``v5p:2x2x2``, ``v6e:4x4``, ``v5e:2x2``, ...: a version,
then the chips along each axis), or a GPU node ``<gpu>x<per node>`` (``h100x8``), several of them
``<gpu>x<per node>x<nodes>`` (``h200x8x2``), described by the files of ``gpu_specs/`` (a ``GpuTargetConfigProto``
in text form each).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
from typing import Optional

from jppo.core.errors import ConfigError

SPECS = pathlib.Path(__file__).parent / "gpu_specs"
GPUS = {"h100": "h100_sxm.txtpb", "h200": "h200_sxm.txtpb"}  # TARGET's gpu name -> its description
GPU_TARGET = re.compile(r"^(?P<gpu>[a-z]\w*?)x(?P<per_node>\d+)(?:x(?P<nodes>\d+))?$")
# HBM per chip of each TPU generation, by the device kind libtpu reports (compile-only devices report no memory)
TPU_MEMORY = {"TPU v4": 32 * 2**30, "TPU v5 lite": 16 * 2**30, "TPU v5": 95 * 2**30, "TPU v6 lite": 32 * 2**30}


@dataclasses.dataclass(frozen=True)
class Target:
    """A machine to compile for: its compile-only ``devices`` (every chip of every host), how many ``hosts`` they
    sit on, and the memory of one device in bytes (None: not known, not checked)."""

    name: str
    platform: str  # "tpu" or "gpu"
    devices: tuple
    hosts: int
    device_memory: Optional[int]


def target(name: str) -> Target:
    """The :class:`Target` ``name`` names; a :class:`ConfigError` in one line for a name that names none."""
    if ":" in name:
        return tpu_target(name)
    match = GPU_TARGET.match(name)
    if match is None:
        raise ConfigError(f"--compile-for {name!r}: not a target: a TPU topology as libtpu names it (v5p:2x2x2, "
                          f"v6e:4x4) or a GPU node <gpu>x<per node>[x<nodes>] ({', '.join(f'{g}x8' for g in GPUS)})")
    return gpu_target(name, match["gpu"], int(match["per_node"]), int(match["nodes"] or 1))


def tpu_target(name: str) -> Target:
    """A TPU slice's compile-only chips, from libtpu (its version must be the one the installed jax pins)."""
    # several processes may load libtpu at once (it would refuse all but one); nothing here runs on a chip
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        from jax.experimental import topologies  # noqa: PLC0415
    except ImportError as error:
        raise ConfigError(f"--compile-for {name!r}: jax cannot describe TPUs here ({error})") from None
    try:
        topology = topologies.get_topology_desc(platform="tpu", topology_name=name)
    except Exception as error:  # noqa: BLE001 (libtpu missing, or a name it does not know: its own message)
        reason = " ".join(str(error).split())[:200]
        hint = "" if "Invalid" in reason else "; the TPU compiler comes with pip install 'jax[tpu]'"
        raise ConfigError(f"--compile-for {name!r}: not a TPU topology libtpu compiles for ({reason}){hint}") from None
    devices = tuple(topology.devices)
    if any(getattr(d, "core_on_chip", 0) for d in devices):
        # v4 (and v3) topologies describe each TensorCore as a device; a run on such chips is one device per chip
        # (megacore), and a mesh over two devices per chip is one jax.make_mesh refuses
        raise ConfigError(
            f"--compile-for {name!r}: libtpu describes this slice with {len(devices)} devices, two per chip "
            f"({devices[0].device_kind}); jppo compiles for one device per chip: a v5e, v5p or v6e topology "
            "(v5p:2x2x2, v6e:4x4)"
        )
    return Target(name, "tpu", devices, len({d.process_index for d in devices}),
                  TPU_MEMORY.get(devices[0].device_kind))


def gpu_target(name: str, gpu: str, per_node: int, nodes: int) -> Target:
    """``nodes`` nodes of ``per_node`` GPUs of the kind ``gpu``, described by ``gpu_specs/``, from jax's CUDA
    plugin (``jax[cuda12]``)."""
    if gpu not in GPUS:
        raise ConfigError(f"--compile-for {name!r}: no description of the GPU {gpu!r} (known: {', '.join(GPUS)})")
    if per_node < 1 or nodes < 1:
        raise ConfigError(f"--compile-for {name!r}: needs at least one GPU per node and one node")
    spec = (SPECS / GPUS[gpu]).read_text()
    try:
        from jax.experimental import topologies  # noqa: PLC0415

        topology = topologies.get_topology_desc(
            platform="cuda", topology_name=f"1x{nodes}x{per_node}", topology=f"1x{nodes}x{per_node}",
            target_config=spec,
        )
    except Exception as error:  # noqa: BLE001 (no CUDA plugin here: its own message)
        reason = " ".join(str(error).split())[:200]
        raise ConfigError(f"--compile-for {name!r}: jax cannot compile for CUDA here ({reason}); the GPU "
                          "compiler comes with pip install 'jax[cuda12]'") from None
    memory = re.search(r"device_memory_size:\s*(\d+)", spec)
    devices = tuple(topology.devices)
    return Target(name, "gpu", devices, nodes, int(memory[1]) if memory else None)
