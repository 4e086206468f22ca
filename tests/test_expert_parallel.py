"""``mesh.expert``: a mixture's experts split over the axis, the tokens exchanged inside the layer
(:func:`jppo.models.moe.expert_parallel`), rows over it everywhere else.

The logits equal the unsharded model's on meshes that combine ``expert`` with every other axis; the sampler's
decoding loop exchanges tokens, never the experts' weights, per decoded token (compiled by the TPU compiler for a
two-host v5p slice); the plan divides the experts' parameters and optimizer state by the axis; a size that does not
divide the experts is refused in one line before anything compiles. The gradient's invariance is
``tests/test_moe_update.py``'s (float64, with K and token budgets)."""

import jax
import numpy as np
import pytest
from flax import nnx

from jppo.config import ConfigError, load_config
from jppo.config.devices import check_mesh
from jppo.models.config import ModelConfig
from jppo.models.decoder import CausalLM
from jppo.models.sharding import create_model
from jppo.parallel.mesh import make_mesh
from jppo.run import compiled, footprint, memory, targets

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
    # the layer with experts is the largest in use (its router and experts against the dense layer's MLP)
    assert m.num_kv_heads * m.head_dim == m.num_heads * m.head_dim == m.hidden_size
    attention = 4 * m.hidden_size ** 2  # q, k, v and o, each D x D here
    router = m.hidden_size * m.num_experts
    for plan, groups in ((on_one, 1), (on_two, 2)):
        assert plan.term("weights_in_use/actor") == 4 * (m.vocab_size * m.hidden_size + attention + router
                                                         + experts // groups)


@pytest.mark.parametrize("expert, per_token", [
    # before, the mixture's global sort made XLA gather the tokens: 4 all-reduces per decoded token on data 8
    (1, {"all-reduce": 1}),
    # the tokens of the expert group (and their routing: weights, experts) gathered, the outputs reduce-scattered;
    # no weight gathered (the experts' weights would add 3 all-gathers)
    (2, {"all-gather": 3, "reduce-scatter": 1, "all-reduce": 1}),
])
def test_a_decoded_token_exchanges_tokens_not_the_experts_weights(expert, per_token):
    cfg = load_config(QUICKSTART_MOE, [f"mesh.expert={expert}", *TINY], data_files=False)
    (rollout,) = compiled.compile_run(cfg, targets.target("v5p:2x2x2"), only=("rollout",))
    assert rollout.compiled, rollout.error
    assert rollout.decode_step_collectives == per_token
