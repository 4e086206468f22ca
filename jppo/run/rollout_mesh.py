"""``rollout.devices: N``: the sampler on a mesh of its own, and the moves between it and the training mesh.

The run's devices are cut in two (:func:`jppo.parallel.mesh.split_devices`): the training mesh, the first ones,
shaped by ``mesh.*``, and the rollout mesh, the last N, a ``data`` axis of N devices. The sampler lays a decoding
batch out by :data:`~jppo.parallel.mesh.DECODING_RULES`: its rows over every batch axis, the weights whole on each
device without a ``tensor`` axis. So on the rollout mesh each device holds a replica of the weights and decodes
rows of its own, with no collective per token.

**The weight move** (:class:`WeightMove`), before every rollout: the weights the schedule names (the current ones,
or the off-policy queue's) are cast to the rollout dtype on the training mesh, where they are, and copied with
``jax.device_put`` to the rollout mesh, replicated. With several processes each one holds devices of both meshes
(:func:`~jppo.parallel.mesh.split_devices`) and copies its own replica of the weights, gathered on the training
mesh, to its own rollout devices (:func:`~jppo.parallel.hostlocal.replicated_on`): a process samples the rows of its
own shards, as in a colocated run, and no weight crosses hosts. The cast is the one the sampler's forward pass makes
itself (:func:`jppo.run.build.kept_in`; the norm scales stay float32), so the sampled tokens and log-probs are those
of the colocated run bit for bit; with LoRA the weights move as they are (the adapters' product is formed in
float32). The bytes are those of one replica; each of the N devices receives them.

**The batch** comes back through the host, as in a colocated run: the sampler's rows are fetched for scoring (the
reward functions read text), and the forward passes and the update take them to the training mesh
(:func:`jppo.engine.assemble.device_rows`).

Both moves are step metrics: ``timing/weight_move`` (seconds, with the other phases), ``perf/weight_move_bytes``
and ``perf/batch_move_bytes`` (the sampled rows' bytes).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jppo.core.experience import Experience
from jppo.parallel.hostlocal import replicated_on
from jppo.parallel.mesh import make_mesh, split_devices
from jppo.run.build import kept_in


def rollout_mesh(devices: list) -> Optional[Mesh]:
    """The rollout's own mesh over ``devices`` (a ``data`` axis of them all); None without devices."""
    return make_mesh(-1, devices=devices) if devices else None


def run_meshes(devices: list, mesh_shape: tuple[int, int, int, int], rollout: int) -> tuple[Mesh, Optional[Mesh]]:
    """The training mesh of ``mesh_shape`` on the first of ``devices`` and the rollout mesh on the last ``rollout``
    (None at 0: the sampler shares the training mesh)."""
    training, sampling = split_devices(devices, rollout)
    return make_mesh(*mesh_shape, devices=training), rollout_mesh(sampling)


def tree_bytes(tree) -> int:
    """Bytes of one copy of the arrays of ``tree``."""
    return int(sum(np.dtype(x.dtype).itemsize * int(np.prod(x.shape)) for x in jax.tree.leaves(tree)))


@dataclasses.dataclass(frozen=True)
class WeightMove:
    """The policy's weights from the training mesh to the rollout ``mesh``: cast to ``dtype`` (None: as they are),
    then replicated over the rollout mesh."""

    mesh: Mesh
    dtype: Optional[str]

    def __call__(self, weights: nnx.State) -> tuple[nnx.State, int]:
        """``weights`` on the rollout mesh, ready (the phase's time is the move's), and the bytes of one replica."""
        cast = weights if self.dtype is None else kept_in(weights, self.dtype, copy=False)
        if jax.process_count() > 1:  # each process copies its own replica (replicated_on): gathered over fsdp first
            cast = gathered_on(jax.tree.leaves(cast)[0].sharding.mesh)(cast)
        moved = replicated_on(cast, self.mesh)
        jax.block_until_ready(moved)
        return moved, tree_bytes(moved)


@functools.lru_cache(maxsize=8)
def gathered_on(mesh: Mesh):
    """A jitted identity whose outputs are whole on every device of ``mesh`` (the all-gather of the training
    mesh's shards), made once per mesh so that each weight move reuses its compiled program."""
    return jax.jit(lambda tree: tree, out_shardings=NamedSharding(mesh, PartitionSpec()))


def batch_bytes(exp: Experience) -> int:
    """Bytes of the sampled rows that cross from the rollout mesh back to the training side."""
    return tree_bytes(exp)  # a pytree of host arrays; the fields it does not hold are None, no leaf
