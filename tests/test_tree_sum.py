"""The fixed summation tree (jppo/parallel/tree_sum.py): the same sum, bit for bit, whether 64 chunks lie on 1, 2, 4
or 8 devices, over one mesh axis or two; equal to the same tree written in numpy; and on inputs where the order of the
additions shows in the bits (a sequential sum differs), so the equality can fail."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

from jppo.parallel.tree_sum import TreeCounter, chunk_tree_sum, tree_combine, tree_psum

CHUNKS = 64


def terms(seed: int = 0) -> np.ndarray:
    """64 chunks of a gradient-like float32 array whose magnitudes span six decades: the order of the additions
    changes the last bits of the sum."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((CHUNKS, 5, 3)) * 10.0 ** rng.uniform(-3, 3, (CHUNKS, 1, 1))).astype(np.float32)


def numpy_tree(chunks: np.ndarray) -> np.ndarray:
    while len(chunks) > 1:
        chunks = (chunks[0::2] + chunks[1::2]).astype(np.float32)
    return chunks[0]


def summed_on(x: np.ndarray, shape: tuple[int, ...], names: tuple[str, ...]) -> np.ndarray:
    """The tree sum of ``x``'s chunks laid out over a mesh of ``shape`` (the chunk axis split over ``names``), as
    every device holds it afterwards (their copies checked equal)."""
    devices = np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape)
    mesh = Mesh(devices, names)
    axes = names if len(names) > 1 else names[0]

    def local(chunks):
        return tree_psum({"g": chunk_tree_sum(chunks)}, axes)["g"][None]

    out = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=PartitionSpec(axes), out_specs=PartitionSpec(axes)))(x)
    copies = np.asarray(out)
    assert all(np.array_equal(copies[0], copy) for copy in copies)  # every device holds the same bits
    return copies[0]


def test_the_sum_is_the_same_bits_on_every_device_count_and_mesh():
    x = terms()
    expected = numpy_tree(x)
    sequential = np.zeros_like(x[0])
    for chunk in x:
        sequential = (sequential + chunk).astype(np.float32)
    assert not np.array_equal(sequential, expected)  # the order shows in these bits
    layouts = [((1,), ("data",)), ((2,), ("data",)), ((4,), ("data",)), ((8,), ("data",)),
               ((2, 4), ("data", "fsdp")), ((4, 2), ("data", "fsdp"))]
    for shape, names in layouts:
        got = summed_on(x, shape, names)
        assert got.dtype == np.float32
        assert np.array_equal(got, expected), (shape, names, np.abs(got - expected).max())


def test_the_default_reduction_gives_other_bits_on_other_device_counts():
    """What the tree replaces: each device's own sum, then ``psum``. On these terms its total on some device count
    differs in its bits from the total on one (XLA:CPU 0.10: on 4 and on 8 devices), where the tree's does not."""
    x = terms()

    def default(n: int) -> np.ndarray:
        mesh = Mesh(np.array(jax.devices()[:n]), ("data",))
        summed = jax.shard_map(lambda c: jax.lax.psum(jnp.sum(c, axis=0), "data")[None], mesh=mesh,
                               in_specs=PartitionSpec("data"), out_specs=PartitionSpec("data"))
        return np.asarray(jax.jit(summed)(x))[0]

    one = default(1)
    assert not all(np.array_equal(one, default(n)) for n in (2, 4, 8))
    assert all(np.array_equal(summed_on(x, (n,), ("data",)), summed_on(x, (1,), ("data",))) for n in (4, 8))


def test_the_tree_needs_a_power_of_two():
    with pytest.raises(ValueError, match=r"^chunks=6: a fixed summation tree needs a power of two$"):
        chunk_tree_sum(np.zeros((6, 2), np.float32))
    mesh = Mesh(np.array(jax.devices()[:6]), ("data",))
    with pytest.raises(ValueError, match=r"devices on data=6: a fixed summation tree needs a power of two"):
        jax.shard_map(lambda v: tree_psum(v, "data"), mesh=mesh, in_specs=PartitionSpec("data"),
                      out_specs=PartitionSpec("data"))(np.zeros((6, 2), np.float32))


def counted(chunks: np.ndarray, pieces: int) -> np.ndarray:
    """The counter's root over ``chunks`` pushed one by one through ``lax.scan``, the run cut into ``pieces``
    consecutive pieces each summed as its own counter and pushed at its level (as micro-batches would be)."""
    per_piece = len(chunks) // pieces

    def piece_sum(piece):
        counter = TreeCounter(per_piece)
        levels, _ = jax.lax.scan(lambda lv, item: (counter.push(lv, *item), None),
                                 counter.init(piece[0]), (jnp.arange(per_piece), piece))
        return counter.root(levels)

    sums = jax.jit(jax.vmap(piece_sum))(chunks.reshape(pieces, per_piece, *chunks.shape[1:]))
    return np.asarray(jax.jit(lambda s: chunk_tree_sum(s))(sums))


def test_the_counter_builds_the_same_tree_one_chunk_at_a_time_however_the_run_is_cut():
    x = terms(1)
    expected = numpy_tree(x)
    for pieces in (1, 2, 8, 64):
        assert np.array_equal(counted(x, pieces), expected), pieces


def test_tree_combine_keeps_the_lower_block_on_the_left():
    """A combine that is not symmetric (left * 3 + right) gives the tree's value, left to right, on every device
    count: each level's lower block is the left operand on both partners."""
    x = terms(2)[:8, 0, 0]

    def lopsided(left, right):
        return jax.tree.map(lambda a, b: a * 3 + b, left, right)

    expected = x.astype(np.float64)
    while len(expected) > 1:
        expected = expected[0::2] * 3 + expected[1::2]
    for n in (1, 2, 4, 8):
        mesh = Mesh(np.array(jax.devices()[:n]), ("data",))

        def local(chunks):
            while chunks.shape[0] > 1:  # the device's own run, the same lopsided tree
                chunks = lopsided(chunks[0::2], chunks[1::2])
            return tree_combine(chunks[0], "data", lopsided)[None]

        out = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=PartitionSpec("data"), out_specs=PartitionSpec("data"),
                                    check_vma=False))(x)
        np.testing.assert_allclose(np.asarray(out), expected[0], rtol=1e-5)  # float32; swapped sides: far off
