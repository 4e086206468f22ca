"""Attention by the flash kernels that ship with JAX's Pallas: splash attention on a TPU, the Triton flash kernel
on a GPU (``model.attention: pallas``). Both take segment ids and a causal mask, keep memory linear in the row and
have their own backward kernels; off their hardware they run in Pallas's interpret mode (how the tests check them
on a CPU, against :func:`jppo.models.layers.reference_attention`).

What they compute differs from the rule of :class:`~jppo.models.attention.AttentionRule` in two places, both fixed
here: a padding query (segment 0) sees the earlier padding keys (their segments are equal), so its output is set to
0 afterwards, as the reference gives (its cotangent is then 0, so nothing flows back into padding keys either);
and the kernels want whole blocks, so a row is padded with segment-0 tokens to a multiple of the block sizes and
cut back. They attend a whole row to itself (slots ``0 .. T-1``, :meth:`AttentionRule.packed`): queries that are a
slice of the row (context parallelism) take ``blockwise`` instead. Grouped-query heads are repeated to the query
heads (the kernels are multi-head; the repeat's gradient sums the group back).

A Mosaic (TPU) or Triton (GPU) kernel is opaque to XLA's partitioner, which refuses to split it across devices:
under a mesh the kernel runs in ``jax.shard_map`` (:func:`_per_shard`), each device on its own rows (the row axes
``data``/``fsdp``) and heads (``tensor``), where they divide the rows and heads; an axis that divides neither holds a
copy of the work. Attention mixes neither rows nor heads, so every shard's result is the single-device one.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, PartitionSpec

from jppo.models.attention import AttentionRule
from jppo.parallel.mesh import fitted_spec, platform

Array = jax.Array

GPU_FORWARD_BLOCK = 128  # the Triton kernel's default forward tiles; larger ones outgrow a GPU's shared memory
GPU_BACKWARD_BLOCK = 32  # and its backward tiles (jax.experimental.pallas.ops.gpu.attention.BlockSizes)
GPU_MIN_BLOCK = 16  # a smaller tile fills less than one tensor-core product (16 rows); short rows are padded to it
TPU_BLOCK = 128  # splash attention's tiles are multiples of 128 tokens (the TPU's lane width)
KERNELS = ("splash", "triton")


def kernel_for(backend: str) -> str:
    """``splash`` on a TPU, ``triton`` elsewhere (on a CPU in interpret mode)."""
    return "splash" if backend == "tpu" else "triton"


def _pad_tokens(x: Array, multiple: int) -> Array:
    pad = -x.shape[1] % multiple
    return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))


def _power_of_two_at_most(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def _power_of_two_at_least(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _gpu_blocks(blocks: tuple[int, int], length: int) -> tuple[int, int, int]:
    """``(block_q, block_k, block_backward)`` for a row of ``length``: powers of two (the only tiles JAX's Triton
    lowering takes), each the configured size rounded down to one, capped at the kernel's own tiles and at the
    smallest power of two that holds the row (a 100-token row takes 128-token tiles, padded); never below
    :data:`GPU_MIN_BLOCK`."""
    block_q, block_k = (max(GPU_MIN_BLOCK, min(_power_of_two_at_most(b), GPU_FORWARD_BLOCK,
                                               _power_of_two_at_least(length))) for b in blocks)
    return block_q, block_k, min(block_q, block_k, GPU_BACKWARD_BLOCK)


def _triton(query: Array, key: Array, value: Array, segments: Array, blocks: tuple[int, int], interpret: bool):
    """The Triton kernel on rows padded to a multiple of its tiles (it pads the head size to a power of two
    itself)."""
    from jax.experimental.pallas.ops.gpu import attention as triton_attention  # noqa: PLC0415 (GPU builds only)

    length, head_dim = query.shape[1], query.shape[-1]
    block_q, block_k, backward = _gpu_blocks(blocks, length)
    sizes = triton_attention.BlockSizes(block_q=block_q, block_k=block_k, block_q_dkv=backward,
                                        block_kv_dkv=backward, block_q_dq=backward, block_kv_dq=backward)
    q, k, v, ids = (_pad_tokens(x, max(block_q, block_k)) for x in (query, key, value, segments))
    out = triton_attention.mha(q, k, v, ids, sm_scale=head_dim**-0.5, causal=True, block_sizes=sizes,
                               interpret=interpret)
    return out[:, :length]


def _splash(query: Array, key: Array, value: Array, segments: Array, blocks: tuple[int, int], interpret: bool):
    from jax.experimental.pallas.ops.tpu import splash_attention as splash  # noqa: PLC0415 (TPU kernels only)

    length, heads, head_dim = query.shape[1:]
    padded = -(-length // TPU_BLOCK) * TPU_BLOCK
    block_q, block_kv = (min(-(-b // TPU_BLOCK) * TPU_BLOCK, padded) for b in blocks)
    padded = -(-padded // math.lcm(block_q, block_kv)) * math.lcm(block_q, block_kv)
    sizes = splash.BlockSizes(block_q=block_q, block_kv=block_kv, block_kv_compute=block_kv, block_q_dkv=block_q,
                              block_kv_dkv=block_kv, block_kv_dkv_compute=block_kv, block_q_dq=block_q,
                              block_kv_dq=block_kv)
    mask = splash.MultiHeadMask([splash.CausalMask((padded, padded)) for _ in range(heads)])
    kernel = splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)
    q = query * jnp.asarray(head_dim**-0.5, query.dtype)  # splash does not scale the scores
    q, k, v = (_pad_tokens(x, padded).transpose(0, 2, 1, 3) for x in (q, key, value))  # [B, H, T, E]
    ids = _pad_tokens(segments, padded)
    row = lambda q, k, v, ids: kernel(q, k, v, segment_ids=splash.SegmentIds(q=ids, kv=ids))  # noqa: E731
    return jax.vmap(row)(q, k, v, ids).transpose(0, 2, 1, 3)[:, :length]


def _per_shard(kernel, query: Array, key: Array, value: Array, segments: Array) -> Array:
    """``kernel(query, key, value, segments)`` (all ``[B, T, H, ...]``, heads already repeated) under the mesh set
    at trace time: in ``jax.shard_map`` over its axes not yet manual, rows over the row axes and heads over
    ``tensor`` where :func:`~jppo.parallel.mesh.fitted_spec` says they divide (else whole on every device). No
    mesh, or one device: the call itself."""
    mesh = jax.sharding.get_abstract_mesh()
    free = () if mesh.empty else tuple(
        name for name, kind in zip(mesh.axis_names, mesh.axis_types) if kind != AxisType.Manual)
    if math.prod(mesh.shape[name] for name in free) == 1:
        return kernel(query, key, value, segments)
    shape = dict(mesh.shape)

    def ours(spec: PartitionSpec) -> PartitionSpec:  # axes an enclosing shard_map made manual are not ours to split
        def kept(axes):
            group = tuple(a for a in ((axes,) if isinstance(axes, str) else (axes or ())) if a in free)
            return group if group else None
        return PartitionSpec(*(kept(axes) for axes in spec))

    heads = ours(fitted_spec(query.shape, ("batch", None, "q_heads", None), shape))
    rows = ours(fitted_spec(segments.shape, ("batch", None), shape))
    # check_vma=False: the kernels' pallas_call declares its outputs without the axes they vary over
    return jax.shard_map(kernel, mesh=mesh, in_specs=(heads, heads, heads, rows), out_specs=heads,
                         axis_names=frozenset(free), check_vma=False)(query, key, value, segments)


def pallas_attention(
    query: Array, key: Array, value: Array, rule: AttentionRule, blocks: tuple[int, int], kernel: str | None = None,
    interpret: bool | None = None,
) -> Array:
    """Grouped-query attention of whole packed rows (``query [B, T, H, E]``, ``key``/``value [B, T, K, E]``, the
    ``rule``'s query segments as the rows' segment ids) by the Pallas ``kernel`` (default: :func:`kernel_for` the
    backend), in interpret mode unless on its own hardware (``interpret`` overrides). ``blocks`` are the configured
    ``(block_q, block_kv)``, fitted to the kernel's tiles."""
    backend = platform()
    kernel = kernel or kernel_for(backend)
    if kernel not in KERNELS:
        raise ValueError(f"Pallas attention kernel {kernel!r} is unknown; valid: {', '.join(KERNELS)}")
    if key.shape[1] != query.shape[1]:
        raise ValueError(
            f"attention='pallas' attends a whole row to itself: {query.shape[1]} queries, {key.shape[1]} keys "
            "(a slice of a row's queries takes attention='blockwise')"
        )
    if interpret is None:
        interpret = backend != ("tpu" if kernel == "splash" else "gpu")
    group = query.shape[2] // key.shape[2]
    key, value = (jnp.repeat(x, group, axis=2) for x in (key, value))
    segments = rule.query_segments.astype(jnp.int32)
    run = _splash if kernel == "splash" else _triton
    out = _per_shard(lambda q, k, v, ids: run(q, k, v, ids, blocks, interpret), query, key, value, segments)
    return jnp.where((segments != 0)[:, :, None, None], out, jnp.zeros_like(out))
