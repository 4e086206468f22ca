"""``mesh.expert``: a mixture's experts split over the axis, the tokens exchanged inside the layer
(:func:`jppo.models.moe.expert_parallel`), rows over it everywhere else.

The logits equal the unsharded model's on meshes that combine ``expert`` with every other axis; the sampler's
decoding loop exchanges tokens, never the experts' weights, per decoded token (compiled by the TPU compiler for a
two-host v5p slice); the plan divides the experts' parameters and optimizer state by the axis; a size that does not
divide the experts is refused in one line before anything compiles. The gradient's invariance is
``tests/test_moe_update.py``'s (float64, with K and token budgets)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

from jppo.config import ConfigError, load_config
from jppo.config.devices import check_mesh
from jppo.models.config import ModelConfig
from jppo.models.decoder import CausalLM
from jppo.models.exchange import gather_routed
from jppo.models.sharding import create_model
from jppo.parallel.mesh import make_mesh
from jppo.preflight import compiled, footprint, memory, targets

CONFIG = ModelConfig(vocab_size=48, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                     model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                     mlp_only_layers=(0,), initializer_range=0.5)
# float32 on both sides, summed in another order (each device adds its own experts' share); measured: ~5e-7 of
# the largest logit
RELATIVE_TOLERANCE = 1e-5
QUICKSTART_MOE = "configs/quickstart_moe.yaml"
TINY = ["trainer.val_every=0", "actor.ppo_epochs=1"]


def logits(shape: tuple[int, ...]) -> np.ndarray:
    """The logits of 8 random rows (left padding in two of them) on a mesh of ``shape`` (data, fsdp, tensor,
    sequence, expert)."""
    mesh = make_mesh(*shape, devices=jax.devices()[: int(np.prod(shape))])
    graphdef, state = nnx.split(create_model(CausalLM, CONFIG, mesh, seed=0))
    ids = np.random.default_rng(0).integers(0, CONFIG.vocab_size, (8, 6))
    segments = np.ones((8, 6), np.int32)
    segments[:2, :2] = 0
    positions = np.maximum(np.cumsum(segments, axis=1) - 1, 0)
    with jax.set_mesh(mesh):
        return np.asarray(jax.jit(lambda s, *x: nnx.merge(graphdef, s)(*x))(state, ids, positions, segments))


@pytest.fixture(scope="module")
def unsharded():
    return logits((1, 1, 1, 1, 1))


@pytest.mark.parametrize("shape", [(1, 2, 2, 1, 2), (1, 1, 1, 2, 4)],
                         ids=["fsdp 2 x tensor 2 x expert 2", "sequence 2 x expert 4"])
def test_logits_equal_the_unsharded_models(unsharded, shape):
    out = logits(shape)
    valid = np.ones((8, 6), bool)
    valid[:2, :2] = False
    error = np.abs(out - unsharded)[valid].max() / np.abs(unsharded[valid]).max()
    assert error < RELATIVE_TOLERANCE, error


def test_a_size_that_does_not_divide_the_experts_is_refused_and_a_dense_model_splits_rows():
    cfg = load_config(QUICKSTART_MOE, ["mesh.expert=3"], data_files=False)
    with pytest.raises(ConfigError) as error:
        check_mesh(cfg, 6)
    assert str(error.value) == ("mesh.expert=3 must divide the actor model's num_experts=8: each device of the axis "
                                "holds an equal group of experts")
    # a model without experts: the axis splits rows, as data does
    dense = load_config("configs/quickstart.yaml", ["mesh.expert=2"], data_files=False)
    assert check_mesh(dense, 8) == (4, 1, 1, 1, 2)


def test_the_plan_divides_the_experts_parameters_and_optimizer_state_by_the_axis():
    one, two = (load_config(QUICKSTART_MOE, [f"mesh.expert={e}"], data_files=False) for e in (1, 2))
    on_one, on_two = memory.memory_plan(one, check_mesh(one, 8)), memory.memory_plan(two, check_mesh(two, 8))
    m = footprint.model_config(one)  # 2 layers, the second with 8 experts of 64 x 32 (gate, up, down)
    experts = 3 * m.num_experts * m.hidden_size * m.moe_intermediate_size
    assert on_one.term("parameters/actor") - on_two.term("parameters/actor") == experts // 2 * 4  # float32
    # AdamW's two float32 moments (one micro-batch per optimizer step on both meshes: no accumulator)
    assert on_one.term("optimizer_state/actor") - on_two.term("optimizer_state/actor") == experts // 2 * 4 * 2
    # the layer with experts is the largest in use (its router and experts against the dense layer's MLP); the
    # actor's table is in use in the LM head's phase, not beside a layer
    assert m.num_kv_heads * m.head_dim == m.num_heads * m.head_dim == m.hidden_size
    attention = 4 * m.hidden_size ** 2  # q, k, v and o, each D x D here
    router = m.hidden_size * m.num_experts
    for plan, groups in ((on_one, 1), (on_two, 2)):
        assert plan.term("weights_in_use/actor") == 4 * (attention + router + experts // groups)


@pytest.mark.parametrize("expert, per_token", [
    # before, the mixture's global sort made XLA gather the tokens: 4 all-reduces per decoded token on data 8 (then
    # 1, the stop test, until each device ran the decoding loop on its own rows)
    (1, {}),
    # the tokens of the expert group with their routing (weights, expert ids) gathered in one collective, the
    # outputs reduce-scattered; no weight gathered (the experts' weights would add 3 all-gathers). The group
    # decodes in step, so its stop test is reduced over it (the all-reduce)
    (2, {"all-gather": 1, "reduce-scatter": 1, "all-reduce": 1}),
])
def test_a_decoded_token_exchanges_tokens_not_the_experts_weights(expert, per_token):
    cfg = load_config(QUICKSTART_MOE, [f"mesh.expert={expert}", *TINY], data_files=False)
    (rollout,) = compiled.compile_run(cfg, targets.target("v5p:2x2x2"), only=("rollout",))
    assert rollout.compiled, rollout.error
    assert rollout.decode_step_collectives == per_token


@pytest.mark.parametrize("num_experts", [256, 512], ids=["ids packed with the tokens", "ids on their own"])
def test_the_group_gathers_every_token_with_its_exact_routing_in_bfloat16(num_experts):
    """bfloat16 holds every integer up to 256 exactly: up to 256 experts the ids ride in the tokens' all-gather,
    above they travel on their own (id 511 would arrive as 512); either way each device gets the group's tokens,
    weights and ids unchanged."""
    mesh = make_mesh(1, 1, 1, 1, 4, devices=jax.devices()[:4])
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(8, 16)), jnp.bfloat16)
    weights = jnp.asarray(rng.uniform(size=(8, 2)), jnp.bfloat16)
    experts = jnp.asarray(rng.choice(num_experts, size=(8, 2), replace=False), jnp.int32).at[0, 0].set(num_experts - 1)
    rows = PartitionSpec("expert")
    gathered = jax.jit(jax.shard_map(lambda *a: gather_routed(*a, num_experts), mesh=mesh, in_specs=(rows,) * 3,
                                     out_specs=(PartitionSpec(),) * 3, check_vma=False))(x, weights, experts)
    for got, want in zip(gathered, (x, weights, experts)):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
