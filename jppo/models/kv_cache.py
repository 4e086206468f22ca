"""The sampler's view of the decoder: its caches (prompt and response keys and values), its copy of the weights, the
response cache's blocks per backend, and the cache write of one decoding step. Pure functions and the caches'
types; :mod:`jppo.models.decoder` calls them."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx, struct

from jppo.models.sharding import decoding_copy, logical_names
from jppo.parallel.mesh import platform

Array = jax.Array


@struct.dataclass
class PromptCache:
    """Every layer's keys and values of a batch of prompts, stored once however many samples each prompt gets.

    ``keys``/``values``: a tuple over layers of ``[B, K / h, P, h E]`` arrays (compute dtype, after RoPE; ``h`` kv
    heads side by side in a row, :func:`lane_group`, as in the response cache); ``visible``: ``[B, P]`` bool, the
    real prompt tokens (padding is never attended).
    """

    keys: tuple[Array, ...]
    values: tuple[Array, ...]
    visible: Array


@struct.dataclass
class ResponseCache:
    """Every layer's keys and values of the generated tokens, ``R`` rows of ``M`` slots (slot ``t`` holds the
    ``t``-th generated token of the row): a tuple over layers of tuples over the blocks of
    :func:`~jppo.models.layers.response_blocks`, ``[R, K / h, M_b, h E]`` each (``h`` kv heads side by side in a
    row, :func:`lane_group`; ``h = 1`` but on a TPU), so that a decoding step reads only the blocks that hold a
    visible slot."""

    keys: tuple[Array, ...]
    values: tuple[Array, ...]

Array = jax.Array

NORM_SCALES = ("input_norm", "post_attention_norm", "q_norm", "k_norm", "norm")  # read in float32 by rms_norm


# Response-cache blocks per backend when SamplingParams.cache_blocks is 0. Each block after the first is a
# ``lax.cond`` per layer and token. XLA:GPU runs a conditional by copying its predicate to the host and waiting,
# so on GPU blocks would make decoding host-latency bound: one block there. On CPU skipping the empty blocks pays:
# a small model's decode step took a quarter less at 128 new tokens (docs/sampling.md). On a TPU one block: the
# decoding kernel (models/decode_kernel.py) reads only the tiles a row sees, and the blocks' partial softmaxes
# cost more than they save there (compiled at the GSM8K GRPO shape, a layer's attention at the last slot read
# 107.7 MiB in 8 blocks against 54.5 in one, bench.decode_bound).
CACHE_BLOCKS = {"gpu": 1, "cpu": 8, "tpu": 1}


# Heads of the response cache stored side by side, per backend, up to this many entries in a row. XLA:TPU tiles
# an array's two minor dimensions in 8 x 128 (the vector lanes), and lays a [R, K, M, E] cache of E < 128 with its
# slots minor so that its lanes fill: a decoding step's write of one slot then rewrites a 128-slot tile column (at
# E = 64 three quarters of the cache's bytes per step, bench.decode_bound). Two heads of 64 side by side fill the
# lanes with the slots major, and the write touches one row of tiles. CPUs and GPUs read rows of any width.
LANES = {"tpu": 128}


def lane_group(num_kv_heads: int, head_dim: int, backend: str | None = None) -> int:
    """``h``: kv heads per row of the response cache, the most (a power of two) whose ``h E`` entries fit
    :data:`LANES` of ``backend`` (default: the traced program's platform) and that divides each device's kv heads
    (the mesh's ``tensor`` axis splits the heads), so that no row spans two devices. 1 on a backend not listed."""
    lanes = LANES.get(backend or platform(), 0)
    mesh = jax.sharding.get_abstract_mesh()
    tensor = 1 if mesh.empty else dict(mesh.shape).get("tensor", 1)
    per_device = num_kv_heads // tensor if num_kv_heads % tensor == 0 else num_kv_heads
    group = 1
    while 2 * group * head_dim <= lanes and per_device % (2 * group) == 0:
        group *= 2
    return group


def cache_rows(x: Array, group: int) -> Array:
    """Keys or values ``[B, K, T, E]`` as a cache stores them, ``[B, K / h, T, h E]``: kv heads ``j h .. j h + h - 1``
    side by side in row ``j`` (``h = group``, :func:`lane_group`)."""
    if group == 1:
        return x
    batch, heads, slots, dim = x.shape
    return x.reshape(batch, heads // group, group, slots, dim).transpose(0, 1, 3, 2, 4).reshape(
        batch, heads // group, slots, group * dim)


def cache_block_count(requested: int, backend: str | None = None) -> int:
    """The response cache's block count: ``requested``, or with ``0`` the :data:`CACHE_BLOCKS` entry of
    ``backend`` (default: the traced program's :func:`~jppo.parallel.mesh.platform`; 8 for a backend not listed)."""
    if requested:
        return requested
    return CACHE_BLOCKS.get(backend or platform(), 8)


def layer_copier(layers: nnx.Module, dtype) -> Callable[[str, Array], Array]:
    """``copy(name, layer)``: the sampler's copy of one layer's slice of the stacked weight ``name`` of ``layers``
    (:func:`~jppo.models.sharding.decoding_copy`), cast to ``dtype`` except the norms' scales."""
    names = {name: logical_names(value)[1:] for name, value in vars(layers).items() if isinstance(value, nnx.Param)}
    return lambda name, layer: decoding_copy(layer, names[name], None if name in NORM_SCALES else dtype)


def with_decoding_copies(model: Any, names: tuple[str, ...]) -> Any:
    """``model`` with the sampler's copies of its parameters called ``names`` (those every decoding step reads
    whole: the embedding table, an untied LM head), cast to the compute dtype, made once before the loop."""
    graphdef, state = nnx.split(model)
    keys = {jax.tree_util.DictKey(name) for name in names}

    def copy(path, variable):
        if path[-1] not in keys:
            return variable
        return variable.replace(decoding_copy(variable[...], logical_names(variable), model.config.compute_dtype))

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(copy, state,
                                                                is_leaf=lambda x: isinstance(x, nnx.Variable)))


def write_slot(block: Array, slots: Array, new: Array) -> Array:
    """``block [R, J, M, C]`` with ``new [R, J, C]`` written at slot ``slots[r]`` of each row ``r`` (or at slot
    ``slots`` of every row, a scalar); a slot outside ``[0, M)`` leaves the row as it was.

    One slot for every row (the decoding loop's case) is one ``dynamic_update_slice``: written in place, the step
    touches ``R K E`` entries. A scatter over the slot axis instead makes XLA:TPU lay the cache out anew for it,
    copying the whole cache twice per layer and step (``bench.decode_bound``). Per-row slots (continuous batching)
    are one write per row (``vmap`` over rows): XLA's partitioner then sees that each row writes only itself, and a
    cache sharded by rows stays so with no communication. The same write as one scatter over ``(arange(R),
    slots)`` is not seen as row-local and gathers every block at every decoding step on a batch-sharded mesh."""
    if jnp.ndim(slots) == 0:
        inside = (slots >= 0) & (slots < block.shape[2])
        at = jnp.clip(slots, 0, block.shape[2] - 1)
        kept = jax.lax.dynamic_slice_in_dim(block, at, 1, axis=2)
        return jax.lax.dynamic_update_slice_in_dim(block, jnp.where(inside, new[:, :, None], kept), at, axis=2)
    return jax.vmap(lambda rows, slot, value: rows.at[:, slot].set(value, mode="drop"))(block, slots, new)
