"""The fixed summation tree (jppo/parallel/tree_sum.py): the same sum, bit for bit, whether 64 chunks lie on 1, 2, 4
or 8 devices, over one mesh axis or two; equal to the same tree written in numpy; and on inputs where the order of the
additions shows in the bits (a sequential sum differs), so the equality can fail."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

from jppo.parallel.tree_sum import chunk_tree_sum, tree_psum

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
