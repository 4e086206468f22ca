"""Process-local rows of the batch, and the global arrays built from them.

With several processes (one per host, ``jax.distributed``), each process holds only the rows of its own batch
shards: it samples, scores and micro-batches those rows, and the global arrays that jitted programs consume are
assembled with ``jax.make_array_from_process_local_data``. Batch shard d (position d along the flattened
``data`` x ``fsdp`` mesh axes) holds global rows ``[d N/D, (d+1) N/D)``; a process's shards are contiguous, so
its rows are one contiguous range. With one process every function here is the identity on whole arrays.
"""

from __future__ import annotations

import functools
from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jppo.parallel.mesh import ROW_AXES, batch_shards

T = TypeVar("T")


@functools.lru_cache(maxsize=16)
def local_shards(mesh: Mesh) -> range:
    """The batch shards whose devices belong to this process (a contiguous range of shard indices)."""
    shards = batch_shards(mesh)
    index_map = NamedSharding(mesh, PartitionSpec(ROW_AXES)).addressable_devices_indices_map((shards,))
    owned = sorted({index[0].start or 0 for index in index_map.values()})
    if owned != list(range(owned[0], owned[0] + len(owned))):
        raise ValueError(
            f"process {jax.process_index()} owns batch shards {owned}, not a contiguous range: order the mesh "
            "devices so that each host's devices are adjacent along the data/fsdp axes"
        )
    return range(owned[0], owned[0] + len(owned))


def local_rows(mesh: Mesh, num_rows: int) -> range:
    """The global rows (of a batch of ``num_rows`` split evenly over the batch shards) held by this process."""
    shards = batch_shards(mesh)
    if num_rows % shards:
        raise ValueError(f"{num_rows} rows cannot be split evenly over {shards} batch shards")
    owned, per_shard = local_shards(mesh), num_rows // shards
    return range(owned.start * per_shard, owned.stop * per_shard)


def to_global(local: np.ndarray, mesh: Mesh, scanned: int = 0) -> jax.Array:
    """The global array whose batch-shard axis (axis ``scanned``, after ``scanned`` replicated leading axes) is
    sharded over the row axes, from this process's part of it."""
    spec = PartitionSpec(*([None] * scanned), ROW_AXES, *([None] * (local.ndim - scanned - 1)))
    sharding = NamedSharding(mesh, spec)
    shape = list(local.shape)
    shape[scanned] = shape[scanned] * batch_shards(mesh) // len(local_shards(mesh))
    return jax.make_array_from_process_local_data(sharding, local, tuple(shape))


def to_local(array: jax.Array, axis: int = 0, rows: range | None = None) -> np.ndarray:
    """This process's part of a global array sharded along ``axis`` (replicas of the same slice counted once), in
    global order; the whole array when it is fully addressable. ``rows``: the global indices along ``axis`` this
    process owns, taken from the array when a program left it replicated instead of sharded."""
    if array.is_fully_addressable:
        local = np.asarray(jax.device_get(array))
    else:
        pieces = {}
        for shard in array.addressable_shards:
            start = shard.index[axis].start or 0
            pieces.setdefault(start, np.asarray(shard.data))
        local = np.concatenate([pieces[start] for start in sorted(pieces)], axis=axis)
    if rows is not None and local.shape[axis] == array.shape[axis] != len(rows):
        local = np.take(local, np.arange(rows.start, rows.stop), axis=axis)
    return local


def on_mesh(arrays: list[np.ndarray], mesh: Mesh | None):
    """The global row-sharded arrays of this process's rows, and the function taking results back to its rows."""
    if mesh is None:
        return [jnp.asarray(a) for a in arrays], np.asarray
    rows = local_rows(mesh, len(arrays[0]) * batch_shards(mesh) // len(local_shards(mesh)))
    return [to_global(np.asarray(a), mesh) for a in arrays], lambda x: to_local(x, rows=rows)


def on_one_device(arrays: list[np.ndarray], mesh: Mesh | None):
    """The whole batch (every process's rows, gathered) on this process's first device, and the function taking
    results back to this process's rows: a batch-wide statistic (advantage whitening, group baselines) then runs as
    one device's program on the whole batch, the same program and so the same bits on any mesh
    (``trainer.deterministic: bitwise``); :func:`on_mesh` spreads it over the mesh instead, whose reductions
    follow the device count."""
    device = jax.local_devices()[0]
    if mesh is None or jax.process_count() == 1:
        return [jax.device_put(np.asarray(a), device) for a in arrays], np.asarray
    whole = [multihost_utils.process_allgather(np.asarray(a), tiled=True) for a in arrays]
    rows = local_rows(mesh, len(whole[0]))
    return [jax.device_put(a, device) for a in whole], lambda x: np.asarray(x)[rows.start:rows.stop]


def take_rows(rows: T, order: np.ndarray, mesh: Mesh, through_devices: bool | None = None) -> T:
    """This process's rows of ``whole[order]`` for every array of the pytree ``rows``, where ``whole`` is the global
    batch of which each array holds this process's rows; the result is split over the batch shards like any batch
    (shard d holds rows ``[d R/D, (d+1) R/D)`` of the ``R = len(order)`` rows).

    With one process every row is already on the host: a numpy take. With several (``through_devices``, the
    default then), the rows travel inside one jitted gather over global arrays, which XLA turns into collectives
    between the devices; each host receives only the rows of its own shards.
    """
    if through_devices is None:
        through_devices = jax.process_count() > 1
    if not through_devices:
        return jax.tree.map(lambda array: np.take(array, order, axis=0), rows)
    shards = batch_shards(mesh)
    if len(order) % shards:
        raise ValueError(f"{len(order)} rows cannot be split evenly over {shards} batch shards")
    whole = jax.tree.map(lambda array: to_global(np.asarray(array), mesh), rows)
    index = jax.make_array_from_process_local_data(NamedSharding(mesh, PartitionSpec()), np.asarray(order, np.int32))
    moved = _row_gather(mesh)(whole, index)
    return jax.tree.map(to_local, moved)


@functools.lru_cache(maxsize=16)
def _row_gather(mesh: Mesh):
    rows = NamedSharding(mesh, PartitionSpec(ROW_AXES))
    return jax.jit(lambda arrays, index: jax.tree.map(lambda a: jnp.take(a, index, axis=0), arrays), out_shardings=rows)


def all_rows(local: np.ndarray, mesh: Mesh) -> np.ndarray:
    """The global ``[N, ...]`` host array of which each process holds its own rows ``local`` (small per-row
    values, e.g. lengths: every process gets every row)."""
    if jax.process_count() == 1:
        return np.asarray(local)
    start = local_rows(mesh, len(local) * batch_shards(mesh) // len(local_shards(mesh))).start
    starts, parts = gathered(np.asarray(start)), gathered(local)
    return np.concatenate([parts[i] for i in np.argsort(starts.reshape(-1), kind="stable")])


def replicated_value(array: jax.Array) -> np.ndarray:
    """The value of a replicated (e.g. fully reduced) global array, read from a local replica."""
    return np.asarray(array.addressable_data(0)) if not array.is_fully_addressable else np.asarray(array)


def gathered(values, tiled: bool = False) -> np.ndarray:
    """``values`` of every process, stacked along a new first axis in process order (``tiled``: concatenated along
    the first axis), every bit kept: JAX without x64 would round 8-byte values (float64, int64) to 32 bits on the
    way, so those travel as pairs of uint32 words."""
    values = np.ascontiguousarray(values)
    if jax.process_count() == 1:
        return values if tiled else values[None]
    if values.dtype.itemsize != 8:
        return np.asarray(multihost_utils.process_allgather(values, tiled=tiled))
    words = np.asarray(multihost_utils.process_allgather(values[..., None].view(np.uint32), tiled=tiled))
    return np.ascontiguousarray(words).view(values.dtype)[..., 0]


def max_over_processes(values) -> np.ndarray:
    """Element-wise maximum of ``values`` over all processes (every process passes the same shape)."""
    return np.max(gathered(values), axis=0)


def sum_over_processes(values) -> np.ndarray:
    """Element-wise sum of ``values`` over all processes, in process order (exact for counts; a float total can
    differ in its last bit from one process's, where :func:`sum_over_rows` does not)."""
    return np.sum(gathered(values), axis=0)


def sum_over_rows(per_row) -> np.ndarray:
    """``sum_r per_row[r]`` in float64 over the global rows, this process holding its own (rows x quantities): one
    array, every process's rows in process order, which is the global rows' order (a process's rows are one
    contiguous range of them: module docstring), summed alike on every process. So the sums have the same bits
    whatever the number of processes; adding each process's own total would reassociate them
    (trainer.deterministic=bitwise logs these)."""
    return gathered(np.asarray(per_row, np.float64), tiled=True).sum(axis=0)


def placed(tree: T, shardings) -> T:
    """``jax.device_put(tree, shardings)`` of values every process holds alike (host values, or this process's own
    single-device arrays of them) onto shardings of the run's mesh (one sharding, or a tree of them).

    With several processes a single-device array travels through host memory: jax's ``device_put`` of one onto a
    replicated sharding of which this process holds a single device returns an array whose one local shard claims
    the whole global sharding; programs still read it, but orbax cannot save it ("the input arrays must have one
    shard each"), which broke every checkpoint of a run of one device per process. A numpy value is placed
    correctly."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)

    def on_host(x):
        return np.asarray(x) if isinstance(x, jax.Array) and x.is_fully_addressable else x

    return jax.device_put(jax.tree.map(on_host, tree), shardings)


def gather_to_host(array: jax.Array) -> np.ndarray:
    """The whole of ``array`` on this host: its shards assembled (from every process when some are remote); a
    single-device CPU array comes back without a copy."""
    if array.is_fully_addressable:
        return np.asarray(jax.device_get(array))
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def replicated_on(tree: T, mesh: Mesh) -> T:
    """``tree``'s arrays, each replicated on the devices of its own mesh, replicated on ``mesh``'s devices.

    In one process a ``jax.device_put``. With several, each process copies its own replica to its own devices of
    ``mesh`` and the global arrays are assembled from those copies: nothing crosses hosts, which a ``device_put``
    between disjoint device sets would need (JAX refuses one across processes unless a cross-host transfer service
    is configured). So every process that holds devices of ``mesh`` must hold a replica: the rollout mesh of
    :func:`jppo.parallel.mesh.split_devices` takes devices of every process of the training mesh."""
    target = NamedSharding(mesh, PartitionSpec())
    if jax.process_count() == 1:
        return jax.device_put(tree, target)
    mine = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]

    def copied(array: jax.Array) -> jax.Array:
        if not array.sharding.is_fully_replicated:
            raise ValueError(f"an array of sharding {array.sharding} is not replicated: move a replica")
        replica = array.addressable_shards[0].data
        return jax.make_array_from_single_device_arrays(array.shape, target, [jax.device_put(replica, d) for d in mine])

    return jax.tree.map(copied, tree)
