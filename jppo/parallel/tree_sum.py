"""Sums whose bits do not depend on how their terms are cut over devices: the reduction order a bitwise mode needs
(issue 53: a run on 1, 2, 4 or 8 devices that logs the same metrics bit for bit).

A float sum's bits depend on the order of its additions. ``psum`` adds the devices' partial sums in an order of
XLA's choosing, and each device's partial sum covers the rows the cut gave it, so the total changes in its last bits
with the device count. Here a sum is one fixed full binary tree over ``2^n`` global chunks of equal shape (chunk
``i`` holds the same terms whatever the layout):

- :func:`chunk_tree_sum`: a device's contiguous run of ``2^j`` chunks, added pairwise level by level
  (``(c0 + c1) + (c2 + c3)``, ...);
- :func:`tree_psum`: then the devices' partial sums by recursive doubling over the axis (inside ``shard_map``): at
  level ``s`` each device adds the partial sum of the device ``2^s`` away, ``ppermute``'d to it. ``a + b`` and
  ``b + a`` have the same bits, so both partners hold the same value after every level, and device ``d``'s value
  after level ``s`` is the tree's node over chunks ``[d' 2^j, (d' + 2^s) 2^j)`` with ``d'`` = ``d`` with its low
  ``s`` bits cleared.

On any power-of-two device count that divides the chunks the additions are the same, at the same tree nodes: the
same sum to the bit. (A chunk's own terms must also be summed the same way wherever it lies: on XLA:CPU a reduction
over a fixed shape gives the same bits in any program, which is what fixed-shape chunks buy.) The cost is
``log2(devices)`` ``ppermute`` exchanges of the summed array in place of one all-reduce.
"""

from __future__ import annotations

from typing import Sequence, Union

import jax

AxisName = Union[str, Sequence[str]]


def _power_of_two(n: int, what: str) -> int:
    if n < 1 or n & (n - 1):
        raise ValueError(f"{what}={n}: a fixed summation tree needs a power of two")
    return n


def chunk_tree_sum(chunks: jax.Array) -> jax.Array:
    """``sum_i chunks[i]`` over the leading axis (a power of two), added pairwise level by level:
    ``((c0 + c1) + (c2 + c3)) + ...``, the same tree whatever else the program holds."""
    _power_of_two(chunks.shape[0], "chunks")
    while chunks.shape[0] > 1:
        chunks = chunks[0::2] + chunks[1::2]
    return chunks[0]


def tree_psum(tree, axis_name: AxisName):
    """The sum over the devices of ``axis_name`` (one mesh axis, or several read row-major as one, as a dimension
    sharded over them is laid out) of each leaf of ``tree``, by recursive doubling: a fixed tree over the devices,
    the same value on every device, bit for bit. Called inside ``shard_map``; the axis size must be a power of
    two. Each device's leaf is its partial sum over its own contiguous run of chunks (:func:`chunk_tree_sum`)."""
    size = _power_of_two(jax.lax.axis_size(axis_name), f"devices on {axis_name}")
    level = 1
    while level < size:
        pairs = [(device, device ^ level) for device in range(size)]
        tree = jax.tree.map(lambda x, p=pairs: x + jax.lax.ppermute(x, axis_name, p), tree)
        level *= 2
    return tree
