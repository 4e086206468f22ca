"""The decoder on meshes of the 8 simulated CPU devices: same numbers as one device, parameters really sharded."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jppo.models import (
    CausalLM,
    ModelConfig,
    ValueModel,
    create_model,
    load_pretrained,
    param_shardings,
    partition_specs,
    save_pretrained,
    token_log_probs,
)
from jppo.parallel.mesh import batch_spec, make_mesh
from jppo.preflight import hlo

CONFIG = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                     num_kv_heads=2, model_type="qwen2")
ROWS, LENGTH = 8, 12
# float32; a sharded matmul sums its partial products in another order than one device does
TOLERANCE = 1e-5


def batch():
    rng = np.random.default_rng(0)
    mask = np.ones((ROWS, LENGTH), np.int32)
    for row in range(ROWS):
        mask[row, : row % 5] = 0  # left padding of 0 to 4 tokens
    ids = np.where(mask, rng.integers(0, CONFIG.vocab_size, (ROWS, LENGTH)), 0).astype(np.int32)
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    return ids, positions, mask


@functools.partial(jax.jit, static_argnums=0)
def forward(graphdef, state, ids, positions, mask):
    return nnx.merge(graphdef, state)(ids, positions, mask)


@functools.partial(jax.jit, static_argnums=0)
def prefill_and_log_probs(graphdef, state, ids, positions, mask):
    model = nnx.merge(graphdef, state)
    hidden, cache = model.prefill(ids, positions, mask)
    log_probs, _ = token_log_probs(model, ids, positions, mask, jnp.roll(ids, -1, axis=1), chunk_size=5)
    return model.logits(hidden), cache, log_probs


@pytest.fixture(scope="module")
def single_device():
    model = create_model(CausalLM, CONFIG, seed=0)
    graphdef, state = nnx.split(model)
    return model, np.asarray(forward(graphdef, state, *batch()))


def assert_close(actual, expected):
    valid = batch()[2].astype(bool)
    actual, expected = np.asarray(actual)[valid], np.asarray(expected)[valid]
    np.testing.assert_allclose(actual, expected, rtol=0, atol=TOLERANCE * np.abs(expected).max())


@pytest.mark.parametrize("shape", [(8, 1, 1), (2, 4, 1), (2, 2, 2)], ids=lambda s: "x".join(map(str, s)))
def test_sharded_forward_equals_single_device(shape, single_device):
    reference_model, reference_logits = single_device
    data, fsdp, tensor = shape
    mesh = make_mesh(data, fsdp, tensor)
    model = create_model(CausalLM, CONFIG, mesh, seed=0)

    layers = model.decoder.layers
    q_proj = layers.q_proj[...]
    assert q_proj.sharding.spec == PartitionSpec(None, "fsdp", "tensor")
    assert q_proj.addressable_shards[0].data.shape == (2, 64 // fsdp, CONFIG.q_size // tensor)
    assert model.decoder.embed_tokens[...].sharding.spec == PartitionSpec("tensor", "fsdp")
    assert layers.down_proj[...].sharding.spec == PartitionSpec(None, "tensor", "fsdp")
    assert model.lm_head[...].sharding.spec == PartitionSpec("fsdp", "tensor")
    assert model.decoder.norm[...].sharding.spec == PartitionSpec(None)
    for got, want in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(reference_model))):
        np.testing.assert_array_equal(got, want)  # sharded initialisation draws the same numbers

    graphdef, state = nnx.split(model)
    rows = NamedSharding(mesh, batch_spec(2))
    inputs = [jax.device_put(x, rows) for x in batch()]
    with jax.set_mesh(mesh):
        logits = forward(graphdef, state, *inputs)
    # rows stay split over the batch axes, the vocabulary over the tensor axis
    assert logits.sharding.is_equivalent_to(NamedSharding(mesh, PartitionSpec(("data", "fsdp"), None, "tensor")), 3)
    assert_close(logits, reference_logits)


def test_cache_and_chunked_log_probs_on_a_tensor_parallel_mesh(single_device):
    reference_model, _ = single_device
    graphdef, state = nnx.split(reference_model)
    expected = prefill_and_log_probs(graphdef, state, *batch())
    mesh = make_mesh(2, 2, 2)
    sharded_state = jax.device_put(state, param_shardings(state, mesh))
    rows = NamedSharding(mesh, batch_spec(2))
    with jax.set_mesh(mesh):
        logits, cache, log_probs = prefill_and_log_probs(graphdef, sharded_state, *[jax.device_put(x, rows)
                                                                                 for x in batch()])
    cache_spec = PartitionSpec(("data", "fsdp"), "tensor", None, None)
    assert cache.keys[0].sharding.is_equivalent_to(NamedSharding(mesh, cache_spec), 4)
    assert_close(logits, expected[0])
    assert_close(log_probs, expected[2])
    valid = batch()[2].astype(bool)
    got, want = np.stack(cache.keys).transpose(0, 1, 3, 2, 4), np.stack(expected[1].keys).transpose(0, 1, 3, 2, 4)
    np.testing.assert_allclose(got[:, valid], want[:, valid], rtol=0, atol=TOLERANCE * np.abs(want).max())


def test_checkpoint_loads_onto_its_shardings_and_critic_head_follows(single_device, tmp_path):
    reference_model, _ = single_device
    save_pretrained(reference_model, tmp_path)
    mesh = make_mesh(2, 2, 2)
    loaded = load_pretrained(tmp_path, mesh=mesh)
    expected_shardings = jax.tree.leaves(param_shardings(loaded, mesh))
    for array, sharding, want in zip(jax.tree.leaves(nnx.state(loaded)), expected_shardings,
                                     jax.tree.leaves(nnx.state(reference_model))):
        assert array.sharding == sharding
        np.testing.assert_array_equal(array, want)
    critic = ValueModel.from_policy(loaded, rngs=nnx.Rngs(0))
    assert critic.value_head.kernel[...].sharding == NamedSharding(mesh, PartitionSpec("fsdp", None))
    assert critic.decoder.layers.q_proj[...].sharding == loaded.decoder.layers.q_proj[...].sharding


@pytest.mark.parametrize("shape", [(1, 1, 8), (2, 1, 4)], ids=lambda s: "x".join(map(str, s)))
def test_dimensions_the_mesh_does_not_divide_stay_replicated(shape):
    # a 14-token vocabulary does not split over 4 or 8 tensor shards: the model must still run there
    config = dataclasses.replace(CONFIG, vocab_size=14)
    ids, positions, mask = batch()
    ids = ids % config.vocab_size
    reference = create_model(CausalLM, config, seed=0)
    expected = forward(*nnx.split(reference), ids, positions, mask)
    mesh = make_mesh(*shape)
    model = create_model(CausalLM, config, mesh, seed=0)
    assert model.decoder.embed_tokens[...].sharding.spec == PartitionSpec(None, "fsdp")
    assert model.lm_head[...].sharding.spec == PartitionSpec("fsdp", None)
    assert model.decoder.layers.q_proj[...].sharding.spec == PartitionSpec(None, "fsdp", "tensor")  # 64 divides
    rows = NamedSharding(mesh, batch_spec(2))
    with jax.set_mesh(mesh):
        logits = forward(*nnx.split(model), *[jax.device_put(x, rows) for x in (ids, positions, mask)])
    assert_close(logits, expected)


def test_partition_specs_follow_the_rule_table_and_agree_with_flax():
    abstract = nnx.eval_shape(lambda: CausalLM(CONFIG, rngs=nnx.Rngs(0)))
    specs = partition_specs(abstract)
    assert specs.decoder.layers.k_proj.get_value() == PartitionSpec(None, "fsdp", "tensor")
    assert specs.decoder.layers.q_bias.get_value() == PartitionSpec(None, "tensor")
    assert specs.decoder.layers.input_norm.get_value() == PartitionSpec(None, None)
    flax_specs = nnx.get_partition_spec(nnx.state(abstract))  # reads the same table through the metadata
    assert jax.tree.structure(specs) == jax.tree.structure(flax_specs)
    assert jax.tree.leaves(specs) == jax.tree.leaves(flax_specs)


def test_the_layer_loop_s_backward_pass_keeps_each_weight_gradient_split_over_fsdp():
    # The layer scan gathers each layer's weights whole (the LM head's chunks the head); the backward pass must sum
    # a layer's (a chunk's) gradient over the devices' rows and keep only its fsdp shard as it goes. Left to itself
    # XLA carried the float32 gradients whole through the loops (22 GiB per device for Qwen2.5-7B's update on 8
    # GPUs, fsdp 8).
    config = dataclasses.replace(CONFIG, layer_loop="scan", remat=True)
    ids, positions, mask = batch()

    def loss(state, graphdef, ids, positions, mask):  # the LM head's chunks: a loop of their own
        log_probs, _ = token_log_probs(nnx.merge(graphdef, state), ids, positions, mask, jnp.roll(ids, -1, axis=1),
                                       chunk_size=4)
        return jnp.sum(jnp.where(mask > 0, log_probs, 0.0))

    grad = jax.jit(jax.grad(loss), static_argnums=1)
    reference_graphdef, reference_state = nnx.split(create_model(CausalLM, config, seed=0))
    expected = grad(reference_state, reference_graphdef, ids, positions, mask)
    mesh = make_mesh(2, 4, 1)
    graphdef, state = nnx.split(create_model(CausalLM, config, mesh, seed=0))
    rows = NamedSharding(mesh, batch_spec(2))
    inputs = [jax.device_put(x, rows) for x in (ids, positions, mask)]
    with jax.set_mesh(mesh):
        compiled = grad.lower(state, graphdef, *inputs).compile()
        got = compiled(state, *inputs)
    carried = " ".join(i.shape for c in hlo.parse(compiled.as_text()).computations.values() for i in c
                       if i.opcode == "while")
    layers = state["decoder"]["layers"]
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"):
        weight = (state["lm_head"] if name == "lm_head" else layers[name])[...]
        assert "fsdp" in weight.sharding.spec
        text = lambda shape: f"f32[{','.join(map(str, shape))}]"  # noqa: E731
        assert text(weight.shape) not in carried, name  # no whole stack of gradients through the loop
        assert text(weight.sharding.shard_shape(weight.shape)) in carried, name
    for got_leaf, want in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        np.testing.assert_allclose(got_leaf, want, rtol=0, atol=TOLERANCE * np.abs(want).max())
