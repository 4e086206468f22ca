"""A decoding step's attention on a TPU: one Pallas kernel over the prompt's and the response's caches.

In plain XLA (:func:`jppo.models.layers.decode_attention`) a decoding step writes each head's float32 scores to
memory and reads them back for the softmax's sum and again for the product with the values, once for the prompt
block and once per response block, and moves the partial results between the prompts' and the rows' layouts.
Compiled for v5p at the GSM8K GRPO shape (Qwen2.5-0.5B, 80 rows a device, 512 + 512 slots) a layer's attention so
read 54.5 MiB against its 24 MiB of caches, and the whole step 1.66x what it cannot avoid reading
(``python -m bench.decode_bound``). This kernel reads each tile of both caches once and keeps the scores in the
core's memory: for each row and query head

    out = sum_m exp(s_m - lse) v_m,    lse = log sum_m exp(s_m),    s_m = scale q . k_m

over the prompt's visible slots ``m`` and the row's first ``lengths[r]`` response slots, by the online softmax
(a running maximum, sum and unnormalized output, rescaled by ``exp(old max - new max)`` at each tile). A program
takes the rows of whole prompts (:func:`prompts_per_program`), so a prompt's tiles are read once for its rows.
A response tile past the last one any row of the program sees is neither read nor computed: its block index repeats
the last visible one, which Pallas does not fetch again, and its body is skipped; so a step early in the response
reads the cache it sees, not the whole cache. A row that sees nothing gets 0.

Operands as the caches store them (:mod:`jppo.models.kv_cache`): ``query [R, J, Q, C]`` (``h`` kv heads side by side
in a cache row: ``C = h E`` lanes, ``Q = h G`` queries, each head's queries zero outside its own lanes),
``prompt_keys``/``prompt_values [B, J, P, C]`` with ``prompt_visible [B, P]`` (rows prompt-major, ``R / B`` a prompt),
``keys``/``values [R, J, M, C]``. It runs on the device's own arrays (inside the decoding loop's ``shard_map``): a
Mosaic kernel is opaque to XLA's partitioner. Off a TPU it runs in Pallas's interpret mode, which is how the tests
check it on a CPU against the XLA computation.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import AxisType, PartitionSpec

from jppo.models.attention import by_product
from jppo.parallel.mesh import platform

Array = jax.Array

ROWS_PER_PROGRAM = 8  # at least this many rows share a program (whole prompts), and so its fixed cost per grid step
BLOCK_SLOTS = 128  # response slots per tile: the granularity at which a step skips the slots no row sees yet
PROMPT_TILE = 512  # prompt slots per tile
LANES = 128


def in_kernel(prompts: int, width: int, rows: int, slots: int, lanes: int, precision, per_row: bool) -> bool:
    """Whether :func:`~jppo.models.layers.decode_attention` takes the kernel: on a TPU, in float32 (a float64
    model's exactness tests stay in XLA), outside the bitwise mode (whose attention normalizes by products:
    :func:`~jppo.models.attention.normalized_by_product`), on the device's own arrays (every mesh axis of more
    than one device manual: the decoding loop's ``shard_map``), where the caches :func:`fit`, and with one slot for
    every row. Under continuous batching (``per_row``: each row at its own slot) the rows' cache writes make XLA lay
    the caches out for a scatter, and the kernel's operands were copied to its layout at every step: compiled for
    v5p (the quickstart at hidden 1024, 64 slots), the rollout held 104.1 MiB against 71.5 in XLA's computation."""
    mesh = jax.sharding.get_abstract_mesh()
    own = mesh.empty or all(kind == AxisType.Manual or mesh.shape[name] == 1
                            for name, kind in zip(mesh.axis_names, mesh.axis_types))
    return (platform() == "tpu" and jnp.dtype(precision) == jnp.float32 and not by_product() and own
            and not per_row and fit(prompts, width, rows, slots, lanes))


def fit(prompts: int, width: int, rows: int, slots: int, lanes: int) -> bool:
    """Whether the kernel takes ``prompts`` prompts of ``width`` slots and ``rows`` rows of ``slots`` response
    slots, cache rows ``lanes`` wide: whole tiles of prompt and response slots, whole lane rows (narrower ones
    would be padded in a TPU's memory) and the same number of rows per prompt."""
    return (rows % prompts == 0 and width % min(width, PROMPT_TILE) == 0 and slots % min(slots, BLOCK_SLOTS) == 0
            and lanes % LANES == 0)


def prompts_per_program(prompts: int, samples: int) -> int:
    """The prompts a program takes: the fewest whose rows reach :data:`ROWS_PER_PROGRAM` that divide ``prompts``."""
    return next(p for p in range(1, prompts + 1) if prompts % p == 0 and (p * samples >= ROWS_PER_PROGRAM
                                                                          or p == prompts))


def decode_attention(query: Array, prompt_keys: Array, prompt_values: Array, prompt_visible: Array, keys: Array,
                     values: Array, lengths: Array, scale: float, known_length: int | None = None,
                     interpret: bool | None = None) -> Array:
    """``out [R, J, Q, C]`` float32: each row's attention over its prompt's visible slots and its first
    ``lengths[r]`` response slots (module docstring). ``prompt_keys``/``prompt_values [B, J, P, C]`` and
    ``prompt_visible [B, P]``, shared by the ``R / B`` consecutive rows of each prompt; ``known_length``: every
    row's length when it is fixed at trace time (for the cost estimate only); ``interpret`` defaults to whether
    the traced program is not for a TPU."""
    rows, groups, queries, lanes = query.shape
    prompts, _, width, _ = prompt_keys.shape
    slots = keys.shape[2]
    if not fit(prompts, width, rows, slots, lanes):
        raise ValueError(f"the decoding kernel takes whole tiles of {PROMPT_TILE} prompt and {BLOCK_SLOTS} response "
                         f"slots and {LANES}-lane rows; got prompts {prompt_keys.shape}, cache {keys.shape}")
    if interpret is None:
        interpret = platform() != "tpu"
    samples = rows // prompts
    per_program = prompts_per_program(prompts, samples)
    programs, prompt_tile, response_tile = prompts // per_program, min(width, PROMPT_TILE), min(slots, BLOCK_SLOTS)
    prompt_tiles, response_tiles = width // prompt_tile, slots // response_tile
    lengths = lengths.astype(jnp.int32)
    # the last response tile any row of a program sees (0 when none sees any: it is read and fully masked)
    last_tile = jnp.maximum(lengths.reshape(programs, per_program * samples).max(axis=1) - 1, 0) // response_tile

    def prompt_tile_of(program, group, tile, lengths_ref, last_ref):
        del lengths_ref, last_ref  # past the prompt, its last tile again: not fetched again
        return program, group, jnp.minimum(tile, prompt_tiles - 1), 0

    def response_tile_of(program, group, tile, lengths_ref, last_ref):
        del lengths_ref  # before the response, its first tile; past the last tile a row sees, that one again
        return program, group, jnp.clip(tile - prompt_tiles, 0, last_ref[program]), 0

    row_block = pl.BlockSpec((per_program * samples, None, queries, lanes), lambda p, g, t, *_: (p, g, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(programs, groups, prompt_tiles + response_tiles),
        in_specs=[row_block,
                  pl.BlockSpec((per_program, None, prompt_tile, lanes), prompt_tile_of),
                  pl.BlockSpec((per_program, None, prompt_tile, lanes), prompt_tile_of),
                  pl.BlockSpec((per_program, 1, prompt_tile),
                               lambda p, g, t, *_: (p, 0, jnp.minimum(t, prompt_tiles - 1))),
                  pl.BlockSpec((per_program * samples, None, response_tile, lanes), response_tile_of),
                  pl.BlockSpec((per_program * samples, None, response_tile, lanes), response_tile_of)],
        out_specs=row_block,
        scratch_shapes=[pltpu.VMEM((per_program * samples, queries, LANES), jnp.float32),
                        pltpu.VMEM((per_program * samples, queries, LANES), jnp.float32),
                        pltpu.VMEM((per_program * samples, queries, lanes), jnp.float32)],
    )
    # What the kernel moves, for XLA's cost model (which cannot see into it): the query, the prompts' keys, values
    # and mask once per program, of the response cache the tiles up to the last one a row sees (all of them unless
    # every row's length is known at trace time: a step compiled at a fixed slot), and its output
    read_slots = slots if known_length is None else min(slots, -(-known_length // response_tile) * response_tile)
    itemsize = jnp.dtype(keys.dtype).itemsize
    cost = pl.CostEstimate(
        flops=4 * rows * groups * queries * (width + read_slots) * lanes,
        transcendentals=rows * groups * queries * (width + read_slots),
        bytes_accessed=(query.size * jnp.dtype(query.dtype).itemsize + 2 * prompt_keys.size * itemsize
                        + prompts * width * 4 + 2 * rows * groups * read_slots * lanes * itemsize + query.size * 4),
    )
    kernel = functools.partial(_kernel, scale=scale, samples=samples, prompt_tiles=prompt_tiles,
                               response_tile=response_tile, dtype=values.dtype)
    call = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(query.shape, jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        cost_estimate=cost,
        interpret=interpret,
    )
    operands = (lengths, last_tile, query, prompt_keys, prompt_values,
                prompt_visible.astype(jnp.int32)[:, None, :], keys, values)
    mesh = jax.sharding.get_abstract_mesh()
    free = () if mesh.empty else frozenset(name for name, kind in zip(mesh.axis_names, mesh.axis_types)
                                           if kind != AxisType.Manual)
    if free:  # axes of one device the enclosing shard_map left automatic: XLA's partitioner refuses Mosaic calls
        call = jax.shard_map(call, mesh=mesh, in_specs=PartitionSpec(), out_specs=PartitionSpec(), axis_names=free,
                             check_vma=False)
    return call(*operands)


def _kernel(lengths_ref, last_ref, query_ref, prompt_keys_ref, prompt_values_ref, prompt_visible_ref, keys_ref,
            values_ref, out_ref, top_ref, total_ref, acc_ref, *, scale: float, samples: int, prompt_tiles: int,
            response_tile: int, dtype) -> None:
    """One program: the rows of its prompts, one row of cache heads, one tile of prompt or response slots."""
    program, tile = pl.program_id(0), pl.program_id(2)
    rows, queries = query_ref.shape[0], query_ref.shape[1]

    @pl.when(tile == 0)
    def _start():
        top_ref[...] = jnp.full(top_ref.shape, -jnp.inf, jnp.float32)
        total_ref[...] = jnp.zeros(total_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def attend(row: int, keys: Array, values: Array, visible: Array) -> None:
        """The online softmax's step for ``row`` over one tile: ``keys``/``values [S, C]``, ``visible [Q, S]``."""
        scores = jax.lax.dot_general(query_ref[row], keys, (((1,), (1,)), ((), ())),
                                     preferred_element_type=jnp.float32) * scale  # [Q, S]
        scores = jnp.where(visible, scores, -jnp.inf)
        old = top_ref[row][:, :1]  # [Q, 1]
        new = jnp.maximum(old, scores.max(axis=1, keepdims=True))
        shift = jnp.where(jnp.isneginf(new), 0.0, new)  # nothing seen yet: exp(-inf - 0) = 0, not nan
        weights = jnp.where(visible, jnp.exp(scores - shift), 0.0)
        rescale = jnp.exp(old - shift)
        total_ref[row] = rescale * total_ref[row] + weights.sum(axis=1, keepdims=True)
        acc_ref[row] = rescale * acc_ref[row] + jax.lax.dot_general(
            weights.astype(dtype), values, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        top_ref[row] = jnp.broadcast_to(new, top_ref.shape[1:])

    @pl.when(tile < prompt_tiles)
    def _prompt():
        for prompt in range(rows // samples):
            visible = jnp.broadcast_to(prompt_visible_ref[prompt] != 0, (queries, prompt_keys_ref.shape[1]))
            for sample in range(samples):
                attend(prompt * samples + sample, prompt_keys_ref[prompt], prompt_values_ref[prompt], visible)

    @pl.when((tile >= prompt_tiles) & (tile - prompt_tiles <= last_ref[program]))
    def _response():
        slot = (tile - prompt_tiles) * response_tile + jax.lax.broadcasted_iota(jnp.int32, (queries, response_tile), 1)
        for row in range(rows):
            attend(row, keys_ref[row], values_ref[row], slot < lengths_ref[program * rows + row])

    @pl.when(tile == pl.num_programs(2) - 1)
    def _finish():
        total = total_ref[...][..., :1]
        out_ref[...] = acc_ref[...] / jnp.where(total > 0, total, 1.0)  # nothing seen: 0
