"""The Pallas kernels (``model.attention: pallas``) on a mesh and for the accelerators' compilers: the kernel split
by ``shard_map`` over rows and heads equals the reference on 8 CPU devices (interpret mode), and a small model's
forward and backward pass with splash attention compiles for a 2-host TPU slice (libtpu's compile-only devices),
which XLA refuses unless the Mosaic kernel is wrapped; Triton's tiles are powers of two."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from test_attention import packed_segments
from test_blockwise_attention import FLOAT32, assert_close, random_qkv, value_and_grads

from jppo.models import CausalLM, ModelConfig, token_log_probs
from jppo.models.attention import AttentionRule
from jppo.models.layers import reference_attention
from jppo.models.pallas_attention import pallas_attention
from jppo.models.sharding import param_shardings
from jppo.parallel.mesh import MESH_AXES, make_mesh


def test_the_kernel_split_over_rows_and_heads_matches_the_reference_on_8_devices():
    """4 rows over ``data`` 4, 4 query heads (2 key-value heads) over ``tensor`` 2: each device runs the kernel on
    one row and two heads (splash attention's interpreter on the CPU; the split is the same for the Triton kernel,
    whose interpreted backward pass compiles several times slower); values and q/k/v gradients equal the unsharded
    reference's to float32 rounding (the same tolerance as one device's kernel)."""
    kernel = "splash"
    mesh = make_mesh(data=4, tensor=2)
    rows, length = [[7, 0, 20, 5], [40], [], [3, 30]], 40
    segments = jnp.asarray(packed_segments(rows, length))
    rule = AttentionRule.packed(segments)
    q, k, v, cotangent = random_qkv(7, len(rows), length, length, heads=4, kv_heads=2)
    expected = value_and_grads(lambda q, k, v: reference_attention(q, k, v, rule.mask()), q, k, v, cotangent)

    def sharded(q, k, v, cotangent, rule):
        return value_and_grads(lambda q, k, v: pallas_attention(q, k, v, rule, (16, 16), kernel=kernel), q, k, v,
                               cotangent)

    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    heads, by_row = PartitionSpec(("data", "fsdp"), None, "tensor"), PartitionSpec(("data", "fsdp"))
    args = (put(q, heads), put(k, heads), put(v, heads), put(cotangent, heads), jax.tree.map(lambda x: put(x, by_row),
                                                                                              rule))
    with jax.set_mesh(mesh):
        assert "shard_map" in str(jax.make_jaxpr(sharded)(*args))
        actual = jax.jit(sharded)(*args)
    for got, want in zip(actual, expected):
        assert_close(got, want, FLOAT32)


def tpu_mesh(shape: tuple[int, int, int, int]) -> Mesh:
    """A (data, fsdp, tensor, sequence) mesh of ``shape``, expert 1."""
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x2")  # 8 chips, 2 hosts
    return Mesh(np.array(topology.devices).reshape(*shape, 1), MESH_AXES)


@pytest.mark.parametrize("shape", [(2, 2, 2, 1), (8, 1, 1, 1)])  # data 2 x fsdp 2 x tensor 2; data 8
def test_a_model_with_splash_attention_compiles_for_a_tpu_slice(shape):
    """Forward and backward pass of a 1-layer model (``attention: pallas``, bfloat16) for a v5p slice of 8 chips on
    2 hosts, compiled by libtpu on this CPU host: XLA cannot partition a Mosaic kernel ("Mosaic kernels cannot be
    automatically partitioned") unless each device's call is its own, in ``shard_map``."""
    mesh = tpu_mesh(shape)
    config = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
                         num_kv_heads=2, model_type="qwen3", max_position_embeddings=128, attention="pallas",
                         attention_block_q=128, attention_block_kv=128, dtype="bfloat16")
    graphdef, state = nnx.split(nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(0))))
    state = jax.tree.map(lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), state,
                         param_shardings(state, mesh))
    tokens = jax.ShapeDtypeStruct((8, 128), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec(("data", "fsdp"))))

    def step(state, ids, positions, segments, targets):
        def loss(state):
            log_probs = token_log_probs(nnx.merge(graphdef, state), ids, positions, segments, targets)[0]
            return jnp.sum(jnp.where(segments > 0, log_probs, 0.0))
        return jax.value_and_grad(loss)(state)

    with jax.set_mesh(mesh):
        compiled = jax.jit(step).lower(state, tokens, tokens, tokens, tokens).compile()
    assert compiled.as_text().count("tpu_custom_call") >= 3  # splash's forward, dq and dkv kernels


@pytest.mark.parametrize("length, blocks", [(100, (128, 128)), (40, (512, 8)), (5, (64, 64))])
def test_the_triton_kernel_takes_power_of_two_tiles_on_any_row(length, blocks):
    """JAX's Triton lowering (pure Python, run here for a CUDA target without a GPU) refuses a tile that is not a
    power of two ("requires that all operations have array arguments and results whose size is a power of 2"):
    a 100-token row took 100-token tiles. Forward and backward lower for CUDA on rows of any length."""
    rule = AttentionRule.packed(jnp.ones((1, length), jnp.int32))
    q = jnp.zeros((1, length, 2, 64), jnp.bfloat16)

    def forward_and_backward(q, k, v):
        out, vjp = jax.vjp(lambda q, k, v: pallas_attention(q, k, v, rule, blocks, "triton", interpret=False), q, k, v)
        return vjp(out)

    text = jax.jit(forward_and_backward).trace(q, q, q).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @__gpu$xla.gpu.triton") == 3  # forward, backward's pre-pass, backward

