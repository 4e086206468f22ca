"""Routing replay (``actor.routing_replay: rollout``): the sampler records each token's experts, and the trainer's
forward passes route by them, so its log-probs of the sampled tokens are those of the experts that sampled them.

The model is engineered so that float32 rounding flips routing choices between the sampler (prefill and KV-cache
decoding) and the trainer (one full forward pass over prompt and response): its one layer with experts has two
experts, one per token, whose router columns are a large common vector plus a small difference, so the two router
logits of every token are nearly tied and their order is decided by rounding, which differs between the two
programs. The test first checks that the routing does flip and moves the log-probs, then that with the record the
trainer's old log-probs equal the sampler's at float32 tolerance, with a fixed and a token-budget cut."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jppo.run.checks  # noqa: F401 (the components' checks of a config, as every command loads them)
from jppo.config import ConfigError, load_config
from jppo.engine import forward_batch, log_prob_fn
from jppo.models.config import ModelConfig
from jppo.models.decoder import CausalLM
from jppo.models.moe import collect_routing, not_recorded
from jppo.models.sharding import create_model
from jppo.parallel.mesh import make_mesh
from jppo.rollout import Sampler, SamplingParams

NUM_EXPERTS = 2
CONFIG = ModelConfig(vocab_size=48, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                     model_type="qwen3_moe", num_experts=NUM_EXPERTS, num_experts_per_tok=1, moe_intermediate_size=8,
                     mlp_only_layers=(0,), initializer_range=0.5, norm_topk_prob=True)
# float32 on both sides, the same tokens through the same experts: the sampler's and the trainer's log-probs then
# differ by the rounding of attention summed in other orders (KV cache vs full pass). Against a float64 pass with the
# recorded experts, each float32 program is at most 8.6e-6 off (18 ulps of a log-prob of 4.3; XLA's CPU code at its
# lowest optimization level, as the suite compiles, 3.3e-6 optimized) and the two may err in opposite directions:
# 2 x 8.6e-6, doubled for other CPUs' code. Without replay the flipped experts move log-probs by up to 3 (72 of 384
# tokens by more than 1e-4): five orders above it.
TOLERANCE = 3e-5


@pytest.fixture(scope="module", params=[0, 12], ids=["every row at once", "continuous batching, 12 slots"])
def rollout(request):
    """A rollout of 8 prompts x 4 samples of 12 tokens, its routing recorded, and the policy it came from; decoded
    all rows at once, or 12 at a time (``rollout.max_num_seqs``)."""
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    model = create_model(CausalLM, CONFIG, mesh, seed=0)
    rng = np.random.default_rng(0)
    common = 1e4 * rng.normal(size=(1, CONFIG.hidden_size, 1))  # logits ~1e4: an ulp of them decides the order
    difference = 1e-3 * rng.normal(size=(1, CONFIG.hidden_size, 1))
    model.decoder.layers.router.value = jnp.asarray(np.concatenate([common, common + difference], -1), jnp.float32)
    graphdef, state = nnx.split(model)
    params = SamplingParams(max_new_tokens=12, n=4, record_routing=True, max_num_seqs=request.param)
    prompts = [rng.integers(1, CONFIG.vocab_size, int(rng.integers(2, 7))).tolist() for _ in range(8)]
    exp = Sampler(graphdef, 0, mesh, params, 8)(state, prompts, jax.random.key(1))
    return exp, graphdef, state, mesh


def own_routing(exp, graphdef, state) -> np.ndarray:
    """The trainer's own experts of every token, ``[N, P + L, 1, 1]``, from one forward pass."""
    ids = np.concatenate([exp.prompt_ids, exp.response_ids], axis=1)
    segments = np.concatenate([exp.prompt_mask, exp.response_attention], axis=1).astype(np.int32)
    with collect_routing() as routed:
        nnx.merge(graphdef, state).hidden_states(ids, np.maximum(np.cumsum(segments, axis=1) - 1, 0), segments)
    return np.moveaxis(np.asarray(routed[0]), 0, 2)


def test_the_sampler_records_every_fed_token_in_one_byte(rollout):
    exp = rollout[0]
    n, p = exp.prompt_ids.shape
    length = exp.response_ids.shape[1]
    assert exp.routed_experts.shape == (n, p + length, 1, 1) and exp.routed_experts.dtype == np.uint8
    recorded = exp.routed_experts[..., 0, 0] != not_recorded(NUM_EXPERTS)
    assert (exp.routed_experts[recorded] < NUM_EXPERTS).all()
    # every prompt column (the prefill routes padding too) and every response token fed back to the model: all but
    # the last of a response that ran to the limit (no EOS here)
    np.testing.assert_array_equal(recorded[:, :p], True)
    np.testing.assert_array_equal(
        recorded[:, p:], np.arange(length)[None, :] < exp.response_attention.sum(1)[:, None] - 1
    )


def test_replay_makes_the_trainers_old_log_probs_the_samplers(rollout):
    exp, graphdef, state, mesh = rollout
    mask = exp.response_mask.astype(bool)
    real = np.concatenate([exp.prompt_mask, exp.response_attention], axis=1).astype(bool)
    recorded = exp.routed_experts[..., 0] != not_recorded(NUM_EXPERTS)
    flipped = (own_routing(exp, graphdef, state) != exp.routed_experts).any(-1) & recorded & real[..., None]
    assert flipped.sum() >= 10  # the routing flips without replay (measured: 100 of 488 tokens)
    log_probs = log_prob_fn(graphdef, temperature=1.0, chunk_size=256)
    own = forward_batch(log_probs, state, dataclasses.replace(exp, routed_experts=None), mesh, micro_batch_size=4)
    assert np.abs(own - exp.rollout_log_prob)[mask].max() > 100 * TOLERANCE
    for cut in (dict(micro_batch_size=4), dict(max_token_len=40)):
        replayed = forward_batch(log_probs, state, exp, mesh, **cut)
        np.testing.assert_allclose(replayed[mask], exp.rollout_log_prob[mask], rtol=0, atol=TOLERANCE, err_msg=str(cut))


@pytest.mark.parametrize("overrides, refusal", [
    (["model.mlp_only_layers=[0,1]"], "has no layer with experts"),
    (["rollout.engine=vllm"], "rollout.engine='vllm'"),
    (["rollout.env=builtin:calculator", "data.task=tool_multiply"], "multi-turn"),
    (["actor.routing_replay=R3"], "actor.routing_replay"),
])
def test_replay_is_refused_in_one_line_where_there_is_nothing_to_replay(overrides, refusal):
    with pytest.raises(ConfigError, match=refusal) as error:
        load_config("configs/quickstart_moe.yaml", ["actor.routing_replay=rollout", *overrides])
    assert "\n" not in str(error.value)
    load_config("configs/quickstart_moe.yaml", ["actor.routing_replay=rollout"])  # a model with experts: accepted


def test_the_record_does_not_depend_on_the_mesh():
    """Decoding with the rows over data 2 and the experts over expert 2 (tokens exchanged inside the layer) records
    the experts decoding on one device records (a model with well-separated router logits: 4 experts, top 2)."""
    config = dataclasses.replace(CONFIG, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, config.vocab_size, int(rng.integers(2, 7))).tolist() for _ in range(4)]
    records = []
    for shape in ((1, 1, 1, 1, 1), (2, 1, 1, 1, 2)):
        mesh = make_mesh(*shape, devices=jax.devices()[: int(np.prod(shape))])
        graphdef, state = nnx.split(create_model(CausalLM, config, mesh, seed=0))
        params = SamplingParams(max_new_tokens=6, n=2, record_routing=True)
        records.append(Sampler(graphdef, 0, mesh, params, 8)(state, prompts, jax.random.key(1)))
    np.testing.assert_array_equal(records[1].response_ids, records[0].response_ids)
    np.testing.assert_array_equal(records[1].routed_experts, records[0].routed_experts)
    assert len(np.unique(records[0].routed_experts[records[0].routed_experts < 4])) == 4  # every expert is chosen
