"""The device mesh and the one sharding rule table.

Three mesh axes: ``data`` (replicas of the parameters, rows of the batch), ``fsdp`` (rows of the batch and shards
of the parameters) and ``tensor`` (shards of the hidden, head and vocabulary dimensions). The batch axes, the
axes that split rows of a batch and so the axes every global count is summed over, are ``data`` and ``fsdp``.

Parameters and activations are annotated with *logical* axis names; :data:`LOGICAL_RULES` maps each logical
name to mesh axes. It is the only place that decides how anything is laid out: change it here and the model,
the engine and checkpoints follow. On a given mesh, :func:`fitted_spec` leaves a dimension the mesh does not
divide replicated.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES: tuple[str, str, str] = ("data", "fsdp", "tensor")
BATCH_AXES: tuple[str, str] = ("data", "fsdp")

# logical axis name -> mesh axis (or axes, or None for replicated)
LOGICAL_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": BATCH_AXES,
    "length": None,
    "vocab": "tensor",
    "embed": "fsdp",
    "mlp": "tensor",
    "q_heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "layers": None,
    "value": None,
}


def logical_to_spec(names: Sequence[str | None]) -> PartitionSpec:
    """``PartitionSpec`` of an array whose dimensions carry the given logical names (``None``: replicated)."""
    axes = []
    for name in names:
        if name is not None and name not in LOGICAL_RULES:
            raise KeyError(f"logical axis {name!r} has no rule; known: {', '.join(sorted(LOGICAL_RULES))}")
        axes.append(None if name is None else LOGICAL_RULES[name])
    return PartitionSpec(*axes)


def fitted_spec(shape: Sequence[int], names: Sequence[str | None], mesh_shape: Mapping[str, int]) -> PartitionSpec:
    """:func:`logical_to_spec` for an array of ``shape`` on a mesh of ``mesh_shape`` (axis name -> size), except
    that a dimension its mesh axes do not divide stays replicated: jit shardings must divide evenly, and a small
    model (a 14-token vocabulary, 2 key-value heads) must still run on any mesh, only less sharded."""
    spec = []
    for size, axes in zip(shape, logical_to_spec(names)):
        group = (axes,) if isinstance(axes, str) else (axes or ())
        shards = int(np.prod([mesh_shape[axis] for axis in group]))
        spec.append(axes if size % shards == 0 else None)
    return PartitionSpec(*spec)


def resolve_shape(data: int, fsdp: int, tensor: int, num_devices: int) -> tuple[int, int, int]:
    """Mesh shape with at most one ``-1`` filled in so that the product is ``num_devices``.

    Raises ``ValueError`` naming ``mesh.<axis>`` when the shape cannot match the device count.
    """
    shape = {"data": data, "fsdp": fsdp, "tensor": tensor}
    free = [name for name, size in shape.items() if size == -1]
    for name, size in shape.items():
        if size == 0 or size < -1:
            raise ValueError(f"mesh.{name}={size} is invalid: use a positive size or -1 to fill")
    if len(free) > 1:
        raise ValueError(f"only one mesh axis may be -1; got {', '.join('mesh.' + n + '=-1' for n in free)}")
    fixed = int(np.prod([size for size in shape.values() if size != -1]))
    if free:
        if num_devices % fixed:
            raise ValueError(
                f"mesh.{free[0]}=-1 cannot fill {num_devices} devices: the other axes multiply to {fixed}"
            )
        shape[free[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise ValueError(
            f"mesh.data={shape['data']} x mesh.fsdp={shape['fsdp']} x mesh.tensor={shape['tensor']} = {fixed} "
            f"devices, but {num_devices} are available"
        )
    return shape["data"], shape["fsdp"], shape["tensor"]


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``(data, fsdp, tensor)`` mesh over ``devices`` (default: all), with one size allowed to be ``-1``.

    Axes are ``Auto``: jit propagates shardings from the inputs and from ``with_sharding_constraint`` hints
    (``jax.make_mesh`` would default to ``Explicit`` axes, which put shardings in the types).
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = resolve_shape(data, fsdp, tensor, len(devices))
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def batch_spec(ndim: int = 2) -> PartitionSpec:
    """Rows over the batch axes, every other dimension replicated."""
    return PartitionSpec(BATCH_AXES, *([None] * (ndim - 1)))


def named(mesh: Mesh, spec: PartitionSpec) -> NamedSharding:
    return NamedSharding(mesh, spec)


def batch_shards(mesh: Mesh) -> int:
    """Number of pieces the batch rows are cut into (product of the batch axes' sizes)."""
    return int(np.prod([mesh.shape[axis] for axis in BATCH_AXES]))
