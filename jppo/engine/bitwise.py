"""The bitwise update: an optimizer step whose gradient, metrics and new weights have the same bits on 1, 2, 4 or 8
devices and under any fixed micro-batch cut (``UpdateConfig.bitwise``; issue 53).

The default step lets XLA sum a mini-batch's gradient: inside each matrix product over a micro-batch's rows, then
over the K micro-batches in order, then over the devices by ``psum``. Each of those orders follows the cut, so the
total changes in its last bits when the micro-batch size or the device count does. Here every sum over rows has one
order, fixed by the rows' global indices:

1. each row (one sequence, the rollout's own layout: fixed micro-batching) is its own chunk: its share of the loss
   (under the whole mini-batch's NormStats, as in the default step) and the gradient of that share are computed on
   one ``[1, W]`` token row, the same shapes wherever the row lies, so the same bits (XLA:CPU's products depend on
   their shapes, not on their neighbours');
2. a device adds its rows' gradients and metric pairs in the fixed binary tree over its contiguous run of rows
   (:class:`~jppo.parallel.tree_sum.TreeCounter`, one row at a time through ``lax.scan``: the micro-batches of a
   fixed cut are consecutive power-of-two runs of the shard's rows, so K does not change the tree);
3. the devices' subtrees meet by recursive doubling (:func:`~jppo.parallel.tree_sum.tree_combine`): the root of the
   same tree over the mini-batch's rows on any power-of-two number of row shards.

The optimizer then runs once on that gradient (no accumulator: ``0 + g`` would turn a ``-0.0`` into ``0.0``), on
every device whole. What it needs: the mini-batch's rows per batch shard a power of two, the row shards a power of
two, no token-budget packing, no tensor, sequence or expert axis (each would split a product's reduction).
:func:`check_bitwise` says which is not so, in one line, before anything is traced. A model with experts: the
mini-batch's expert fractions are counts (exact in any order), and each row's share of the router losses is summed
in the tree like the rest.

The price: the rows run one after another (no batching over rows: products of ``W`` tokens instead of ``K W``), the
parameters are whole on every row shard during the step (gathered once), and the gradient crosses the devices in
``log2(shards)`` ``ppermute`` exchanges instead of one all-reduce.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from jppo.core import metrics as metrics_lib
from jppo.core.errors import InvalidSetting
from jppo.parallel.mesh import ROW_AXES, batch_shards
from jppo.parallel.tree_sum import TreeCounter, tree_combine

SPLITTING_AXES = ("tensor", "sequence", "expert")  # axes that split a product's reduction or the router's sums


def check_bitwise(cfg, mesh: Mesh) -> None:
    """:class:`~jppo.core.errors.InvalidSetting` naming the first thing a bitwise update (``cfg.bitwise``) cannot
    run on: token-budget packing, legacy normalization, a mesh axis other than data and fsdp of size > 1, a row-shard
    count that is not a power of two."""
    if not getattr(cfg, "bitwise", False):
        return
    name = type(cfg).__name__ + "."
    if cfg.use_dynamic_bsz:
        raise InvalidSetting(name, "use_dynamic_bsz", True, "false with bitwise (one sequence per row)")
    if cfg.normalization != "global":
        raise InvalidSetting(name, "normalization", cfg.normalization, "global with bitwise")
    for axis in SPLITTING_AXES:
        if dict(mesh.shape).get(axis, 1) > 1:
            raise InvalidSetting("mesh.", axis, dict(mesh.shape)[axis], "1 with bitwise (it splits a sum)")
    shards = batch_shards(mesh)
    if shards & (shards - 1):
        raise InvalidSetting("mesh.", "data x fsdp", shards, "a power of two with bitwise")


def pair_combine(left, right):
    """A (gradient, metric pairs) node of the tree: gradients added, metric pairs combined by their kind."""
    return jax.tree.map(jnp.add, left[0], right[0]), metrics_lib.combine(left[1], right[1])


def bitwise_gradient(
    share_gradient_of: Callable[[Any, Any], tuple[Any, dict]], params, batch, mesh: Mesh, dtype, routes: bool = False,
) -> tuple[Any, dict]:
    """The mini-batch's gradient (in ``dtype``) and metric pairs, summed over its rows in the fixed tree (module
    docstring): ``share_gradient_of(params, row)`` is one row's ``(gradient, metric pairs)`` (a row without a
    response token gives zeros without running it; with ``routes``, an actor with experts, a row without any
    token), ``batch`` the mini-batch's micro-batches ``[K, D, R, W]``
    (fixed cut: R = S, one sequence per row) with D over the row axes. The result is the same on every device."""
    k, _, rows, width = batch.input_ids.shape
    if rows != batch.slots.response_mask.shape[2]:
        raise ValueError(f"bitwise: {rows} token rows for {batch.slots.response_mask.shape[2]} sequences (packed)")
    local_rows = k * rows
    if local_rows & (local_rows - 1):
        raise InvalidSetting("", "rows per batch shard", local_rows, "a power of two with bitwise")
    one_row = jax.tree.map(lambda x: jax.ShapeDtypeStruct((1, 1, *x.shape[3:]), x.dtype), batch)
    shapes = jax.eval_shape(share_gradient_of, params, one_row)
    counter = TreeCounter(local_rows, pair_combine)

    def zeros(dtype_of=lambda s: s.dtype):
        return jax.tree.map(lambda s: jnp.zeros(s.shape, dtype_of(s)), shapes)

    def row_gradient(params, row):
        holds = jnp.any(row.slots.response_mask)
        holds = holds | jnp.any(row.segment_ids != 0) if routes else holds  # its tokens' share of the router loss
        return jax.lax.cond(holds, share_gradient_of, lambda p, r: zeros(), params, row)

    def local(params, batch):
        flat = jax.tree.map(lambda x: x.reshape(local_rows, 1, 1, *x.shape[3:]), batch)  # row i = k * R + r

        def add_row(levels, item):
            index, row = item
            # the row's gather index into its own [1, W] grid instead of the micro-batch's [R, W] one
            row = dataclasses.replace(row, gather_index=row.gather_index - (index % rows) * width)
            grads, metrics = row_gradient(params, row)
            grads = jax.tree.map(lambda g: g.astype(dtype), grads)
            return counter.push(levels, index, (grads, metrics)), None

        start = (zeros(lambda s: dtype)[0], zeros()[1])
        levels, _ = jax.lax.scan(add_row, counter.init(start), (jnp.arange(local_rows), flat))
        return tree_combine(counter.root(levels), ROW_AXES, pair_combine)

    batch_spec = jax.tree.map(lambda _: PartitionSpec(None, ROW_AXES), batch)
    return jax.shard_map(local, mesh=mesh, in_specs=(PartitionSpec(), batch_spec), out_specs=PartitionSpec(),
                         check_vma=False)(params, batch)
