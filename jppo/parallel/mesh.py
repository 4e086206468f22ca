"""The device mesh and the one sharding rule table.

Five mesh axes: ``data`` (replicas of the parameters, rows of the batch), ``fsdp`` (rows of the batch and shards
of the parameters), ``tensor`` (shards of the hidden, head and vocabulary dimensions), ``sequence`` (context
parallelism: the tokens of every packed row of a training or log-prob pass, split in contiguous blocks) and
``expert`` (expert parallelism: the stacked experts of a mixture split among its devices, and, everywhere else, rows
of the batch as ``data`` splits them, so that no device of the axis idles outside the experts; the tokens meet their
experts inside :func:`jppo.models.moe.moe_mlp`). The row axes, which split the rows of a batch, are ``data``,
``fsdp`` and ``expert`` (:data:`ROW_AXES`); the batch axes, which split rows or tokens and so are the axes every
global count is summed over, are those and ``sequence`` (:data:`BATCH_AXES`,
docs/contract.md#every-new-axis-is-a-batch-axis).

Parameters and activations are annotated with *logical* axis names; :data:`LOGICAL_RULES` maps each logical
name to mesh axes. It is the only place that decides how anything is laid out: change it here and the model,
the engine and checkpoints follow. On a given mesh, :func:`fitted_spec` leaves a dimension the mesh does not
divide replicated.

The sampler lays its arrays out by :data:`DECODING_RULES` (:func:`decoding_layout`), the same table with two rows
changed: a decoding step has one token per row, so there are no tokens of a row to split, and every batch axis
splits the rows instead (``batch`` -> ``data, fsdp, sequence``; ``length`` -> whole). Each device then decodes rows
of its own from its own caches and weights: no collective per decoded token on a mesh of batch axes, and no matmul
repeated on the devices of the ``sequence`` axis.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Collection, Iterator, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

# sequence and expert last: 1-sized axes leave the devices where a (data, fsdp, tensor) mesh put them
MESH_AXES: tuple[str, ...] = ("data", "fsdp", "tensor", "sequence", "expert")
EXPERT_AXIS = "expert"
ROW_AXES: tuple[str, ...] = ("data", "fsdp", EXPERT_AXIS)
SEQUENCE_AXIS = "sequence"
BATCH_AXES: tuple[str, ...] = (*ROW_AXES, SEQUENCE_AXIS)

# logical axis name -> mesh axis (or axes, or None for replicated)
LOGICAL_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ROW_AXES,
    "length": SEQUENCE_AXIS,  # the tokens of a row (activations); size 1 unless context-parallel
    "vocab": "tensor",
    "embed": "fsdp",
    "mlp": "tensor",
    "q_heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "layers": None,
    "value": None,
    "experts": EXPERT_AXIS,  # the experts of a mixture, stacked
}

# The sampler's table: the rows of a decoding batch over every batch axis, a row's slots whole on its device.
DECODING_RULES: dict[str, str | tuple[str, ...] | None] = {**LOGICAL_RULES, "batch": BATCH_AXES, "length": None}

# The table in force while a program is traced; a context variable, so that a rollout traced on a thread of its own
# (trainer.off_policy_steps) does not change the layout of an update traced beside it.
_RULES: contextvars.ContextVar[Mapping[str, str | tuple[str, ...] | None]] = contextvars.ContextVar(
    "jppo_logical_rules", default=LOGICAL_RULES)


@contextlib.contextmanager
def decoding_layout() -> Iterator[None]:
    """Within it, logical names map to mesh axes by :data:`DECODING_RULES` (the sampler's layout); the rollout
    program is traced inside it, every other program by :data:`LOGICAL_RULES`."""
    token = _RULES.set(DECODING_RULES)
    try:
        yield
    finally:
        _RULES.reset(token)


def logical_rules() -> Mapping[str, str | tuple[str, ...] | None]:
    """The rule table in force: :data:`DECODING_RULES` inside :func:`decoding_layout`, else :data:`LOGICAL_RULES`."""
    return _RULES.get()


def logical_to_spec(names: Sequence[str | None]) -> PartitionSpec:
    """``PartitionSpec`` of an array whose dimensions carry the given logical names (``None``: replicated), by the
    rule table in force (:func:`logical_rules`)."""
    rules, axes = logical_rules(), []
    for name in names:
        if name is not None and name not in rules:
            raise KeyError(f"logical axis {name!r} has no rule; known: {', '.join(sorted(rules))}")
        axes.append(None if name is None else rules[name])
    return PartitionSpec(*axes)


def fitted_spec(shape: Sequence[int], names: Sequence[str | None], mesh_shape: Mapping[str, int],
                skip: Collection[str] = ()) -> PartitionSpec:
    """:func:`logical_to_spec` for an array of ``shape`` on a mesh of ``mesh_shape`` (axis name -> size), except
    that a dimension its mesh axes do not divide stays replicated: jit shardings must divide evenly, and a small
    model (a 14-token vocabulary, 2 key-value heads) must still run on any mesh, only less sharded. The axes in
    ``skip`` are left out (an enclosing ``shard_map``'s manual axes: ``shape`` is one device's already)."""
    spec = []
    for size, axes in zip(shape, logical_to_spec(names)):
        group = tuple(axis for axis in ((axes,) if isinstance(axes, str) else (axes or ())) if axis not in skip)
        axes = group[0] if len(group) == 1 else (group or None)
        shards = int(np.prod([mesh_shape.get(axis, 1) for axis in group]))
        spec.append(axes if size % shards == 0 else None)
    return PartitionSpec(*spec)


def resolve_shape(
    data: int, fsdp: int, tensor: int, num_devices: int, sequence: int = 1, expert: int = 1
) -> tuple[int, int, int, int, int]:
    """Mesh shape ``(data, fsdp, tensor, sequence, expert)`` with at most one ``-1`` filled in so that the product
    is ``num_devices``.

    Raises ``ValueError`` naming ``mesh.<axis>`` when the shape cannot match the device count.
    """
    shape = {"data": data, "fsdp": fsdp, "tensor": tensor, "sequence": sequence, "expert": expert}
    free = [name for name, size in shape.items() if size == -1]
    for name, size in shape.items():
        if size == 0 or size < -1:
            raise ValueError(f"mesh.{name}={size} is invalid: use a positive size or -1 to fill")
    for name in ("sequence", "expert"):
        if shape[name] > 1 and num_devices % shape[name]:
            raise ValueError(f"mesh.{name}={shape[name]} does not divide the {num_devices} devices")
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
            " x ".join(f"mesh.{name}={size}" for name, size in shape.items()) + f" = {fixed} "
            f"devices, but {num_devices} are available"
        )
    return shape["data"], shape["fsdp"], shape["tensor"], shape["sequence"], shape["expert"]


def row_shards_of(shape: Sequence[int]) -> int:
    """Number of pieces the batch rows are cut into on a mesh of ``shape`` (:data:`MESH_AXES` order, as
    :func:`resolve_shape` returns it): the product of the row axes' sizes."""
    sizes = dict(zip(MESH_AXES, shape))
    return int(np.prod([sizes.get(axis, 1) for axis in ROW_AXES]))


def make_mesh(
    data: int = -1, fsdp: int = 1, tensor: int = 1, sequence: int = 1, expert: int = 1,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """A ``(data, fsdp, tensor, sequence, expert)`` mesh over ``devices`` (default: all), with one size allowed to
    be ``-1``.

    Axes are ``Auto``: jit propagates shardings from the inputs and from ``with_sharding_constraint`` hints
    (``jax.make_mesh`` would default to ``Explicit`` axes, which put shardings in the types).
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = resolve_shape(data, fsdp, tensor, len(devices), sequence, expert)
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


def split_devices(
    devices: Sequence[jax.Device], rollout: int
) -> tuple[list[jax.Device], list[jax.Device]]:
    """The run's ``devices`` cut into the training mesh's and the rollout mesh's (``rollout`` of them; none when 0).

    The rollout takes each process's last devices, ``rollout / P`` per process of the P that hold ``devices``: in one
    process the last ``rollout``, so that the training mesh on the first ones is the mesh a colocated run on that
    many devices builds; with several, every process keeps devices of both meshes, so a process samples its own rows
    and its rollout devices take the weights from its own training devices (no byte crosses hosts,
    :func:`jppo.parallel.hostlocal.replicated_on`). The caller checks that ``rollout`` divides over the processes
    (:func:`jppo.config.devices.training_devices`)."""
    devices = list(devices)
    by_process: dict[int, list[jax.Device]] = {}
    for device in devices:
        by_process.setdefault(device.process_index, []).append(device)
    per_process = rollout // len(by_process)
    training, sampling = [], []
    for own in by_process.values():
        cut = len(own) - per_process
        training += own[:cut]
        sampling += own[cut:]
    return training, sampling


def batch_spec(ndim: int = 2) -> PartitionSpec:
    """Rows over the row axes, every other dimension replicated."""
    return PartitionSpec(ROW_AXES, *([None] * (ndim - 1)))


GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def platform() -> str:
    """The platform of the program being traced: that of the devices of the mesh set with ``jax.set_mesh``
    (``"tpu"``, ``"gpu"`` or ``"cpu"``), else JAX's default backend.

    Read at trace time wherever a program's choice depends on the hardware (attention kernels, Pallas interpret
    mode, cache blocks), never ``jax.default_backend()``: a program for a TPU or GPU mesh traced on a CPU host, with
    the compile-only devices of ``jax.experimental.topologies``, must pick the target's kernels, not the host's."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else mesh.abstract_device
    if device is None:
        return jax.default_backend()
    return "gpu" if device.platform in GPU_PLATFORMS else device.platform


def named(mesh: Mesh, spec: PartitionSpec) -> NamedSharding:
    return NamedSharding(mesh, spec)


def batch_shards(mesh: Mesh) -> int:
    """Number of pieces the batch rows are cut into (product of the row axes' sizes)."""
    return int(np.prod([mesh.shape[axis] for axis in ROW_AXES]))


def decoding_shards(mesh_shape: Mapping[str, int]) -> int:
    """Number of pieces the sampler cuts its rows into (:data:`DECODING_RULES`' ``batch``: every batch axis)."""
    return int(np.prod([mesh_shape.get(axis, 1) for axis in DECODING_RULES["batch"]]))


def sequence_shards(mesh_shape: Mapping[str, int]) -> int:
    """Number of pieces each row's tokens are cut into (the ``sequence`` axis' size; 1 on a mesh without it)."""
    return int(mesh_shape.get(SEQUENCE_AXIS, 1))


def expert_shards(mesh_shape: Mapping[str, int]) -> int:
    """Number of pieces a mixture's experts are split into (the ``expert`` axis' size; 1 on a mesh without it)."""
    return int(mesh_shape.get(EXPERT_AXIS, 1))


def decoding_loop_axes(rows: int, slots: int, has_experts: bool) -> tuple[str, ...]:
    """The axes of the mesh set at trace time over which each device runs a decoding loop on its own ``rows``
    (:func:`on_each_device`), ``slots`` of them decoded at once: those of size > 1 that split the rows in the
    sampler's layout (:data:`DECODING_RULES`), but ``expert`` on a mixture (the group's devices exchange tokens in
    every layer, so they decode in step); none where the rows or the slots do not divide over them (the loop then
    runs on the global rows, its stop test reduced over them)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    spec = fitted_spec((rows,), ("batch",), dict(mesh.shape), mesh.manual_axes)[0]
    axes = tuple(axis for axis in ((spec,) if isinstance(spec, str) else (spec or ()))
                 if mesh.shape[axis] > 1 and not (axis == EXPERT_AXIS and has_experts))
    shards = int(np.prod([mesh.shape[axis] for axis in axes]))
    return axes if rows % shards == 0 and slots % shards == 0 else ()


def on_each_device(loop: Callable, axes: tuple[str, ...], rows: tuple, shared: tuple):
    """``loop(*rows, *shared)`` run by each device of the mesh ``axes`` on its own rows, in ``shard_map``: every
    array of ``rows`` has its rows first, split over ``axes`` (a scalar is the same on every device), ``shared``
    is the same on every device of ``axes`` (the sampler's weights: replicated over the batch axes), and every
    output has its rows (or one entry per device) first. So a decoding loop's stop test is each device's own: a
    decoded token communicates nothing over ``axes``, and a device whose rows have ended stops while others
    decode on. No axes: the call itself."""
    if not axes:
        return loop(*rows, *shared)
    spec = PartitionSpec(axes)
    specs = (jax.tree.map(lambda x: spec if np.ndim(x) else PartitionSpec(), rows),
             jax.tree.map(lambda _: PartitionSpec(), shared))
    # check_vma=False: the loop's step count is each device's own though nothing it is computed from varies
    return jax.shard_map(lambda r, s: loop(*r, *s), mesh=jax.sharding.get_abstract_mesh(), in_specs=specs,
                         out_specs=spec, axis_names=frozenset(axes), check_vma=False)(rows, shared)
