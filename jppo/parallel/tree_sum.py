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

The same tree serves any pairwise ``combine`` (the metric pairs' :func:`jppo.core.metrics.combine`, whose moment
merge is not symmetric in its arguments): :func:`tree_combine` across devices puts the lower block on the left, and
:class:`TreeCounter` builds a device's tree one chunk at a time inside ``lax.scan`` (a binary counter: ``log2``
partial sums alive, never the stacked chunks).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence, Union

import jax
import jax.numpy as jnp

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


Combine = Callable[[Any, Any], Any]


def add(left, right):
    """The sum of two trees, leaf by leaf (:func:`tree_combine`'s and :class:`TreeCounter`'s default)."""
    return jax.tree.map(jnp.add, left, right)


def tree_combine(tree, axis_name: AxisName, combine: Combine = add):
    """:func:`tree_psum` with any pairwise ``combine(left, right)``: at each level the device whose block comes
    first (its bit clear) is the left operand on both partners, so both compute the same node."""
    size = _power_of_two(jax.lax.axis_size(axis_name), f"devices on {axis_name}")
    index = jax.lax.axis_index(axis_name)
    level = 1
    while level < size:
        pairs = [(device, device ^ level) for device in range(size)]
        other = jax.tree.map(lambda x, p=pairs: jax.lax.ppermute(x, axis_name, p), tree)
        first = (index & level) == 0
        left = jax.tree.map(lambda a, b: jnp.where(first, a, b), tree, other)
        right = jax.tree.map(lambda a, b: jnp.where(first, b, a), tree, other)
        tree = combine(left, right)
        level *= 2
    return tree


class TreeCounter:
    """The fixed tree over ``n`` (a power of two) chunks, built one chunk at a time in order, as a binary counter
    carried through ``lax.scan``: level ``j`` holds the finished node over the last ``2^j`` chunks while it waits for
    its right sibling. :meth:`push` of chunk ``i`` merges it up through the levels where ``i`` has a 1 bit
    (``combine(level_j, node)``, left then right) and parks the node at its first 0 bit; after the last chunk the root
    is level ``log2 n`` (:meth:`root`). The nodes are those of :func:`chunk_tree_sum` over the same chunks, so a run
    of chunks cut into consecutive power-of-two pieces, each pushed (or each a subtree pushed at its level) in order,
    gives the same bits however it was cut."""

    def __init__(self, n: int, combine: Combine = add):
        self.depth = _power_of_two(n, "chunks").bit_length() - 1
        self.combine = combine

    def init(self, like):
        """The carry: ``depth + 1`` levels shaped like one chunk's tree ``like`` (zeros; a level is read only once
        written)."""
        return [jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), like) for _ in range(self.depth + 1)]

    def push(self, levels: list, index: jax.Array, node) -> list:
        """``levels`` after chunk ``index`` (0-based, in order) with value ``node``."""
        levels, active = list(levels), jnp.asarray(True)
        for j in range(self.depth + 1):
            bit = (index >> j) & 1 if j < self.depth else jnp.zeros_like(index)
            merged = self.combine(levels[j], node)
            park = active & (bit == 0)
            levels[j] = jax.tree.map(lambda new, old: jnp.where(park, new, old), node, levels[j])
            node = jax.tree.map(lambda m, n: jnp.where(active & (bit == 1), m, n), merged, node)
            active = active & (bit == 1)
        return levels

    def root(self, levels: list):
        """The tree's value once all ``n`` chunks are pushed."""
        return levels[self.depth]
