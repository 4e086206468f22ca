"""The qwen3_moe family against transformers' Qwen3MoeForCausalLM: logits, checkpoints both ways, the router's
load-balancing loss; LoRA on a model with experts."""

import functools

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from jppo.core.settings import LoRAConfig
from jppo.models import load_pretrained, save_pretrained
from jppo.models.lora import attach_lora, merged
from jppo.models.moe import collect_router_stats, load_balancing_loss

SIZES = dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, num_experts=6, num_experts_per_tok=2, max_position_embeddings=64)
CONFIGS = {
    # layers 1 and 3 hold experts by decoder_sparse_step=2, and mlp_only_layers takes 3 back: one layer with
    # experts between dense ones (the layers run one by one)
    "mixed": dict(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=True),
    # every layer with experts (one scan over the layers)
    "sparse": dict(num_hidden_layers=2, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=False),
}
# float32 on both sides; they differ in summation order only (measured: ~5e-7 of the largest logit)
RELATIVE_TOLERANCE = 1e-5


def left_padded_batch():
    mask = np.array([[0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1, 1, 1]])
    ids = np.random.default_rng(0).integers(0, SIZES["vocab_size"], mask.shape)
    return ids, np.maximum(mask.cumsum(axis=1) - 1, 0), mask


def torch_outputs(model, output_router_logits=False):
    ids, positions, mask = left_padded_batch()
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                     position_ids=torch.tensor(positions), output_router_logits=output_router_logits)


@functools.partial(jax.jit, static_argnums=0)
def _apply(graphdef, state, ids, positions, mask):
    with collect_router_stats() as stats:
        logits = nnx.merge(graphdef, state)(ids, positions, mask)
    return logits, stats[0]


def jppo_outputs(model):
    graphdef, state = nnx.split(model)
    return jax.device_get(_apply(graphdef, state, *left_padded_batch()))


def assert_match(actual, expected, tolerance=RELATIVE_TOLERANCE):
    valid = left_padded_batch()[2].astype(bool)
    error = np.abs(actual - expected)[valid].max() / np.abs(expected[valid]).max()
    assert error < tolerance, error


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (directory of a saved random Qwen3MoeForCausalLM, that model)."""
    saved = {}
    for name, layout in CONFIGS.items():
        torch.manual_seed(0)
        # a wide initialization, so that the router's choices differ from token to token
        config = transformers.Qwen3MoeConfig(initializer_range=0.2, **SIZES, **layout)
        model = transformers.Qwen3MoeForCausalLM(config).eval()
        with torch.no_grad():  # norms away from 1, so that each of them matters
            for key, tensor in model.named_parameters():
                if "norm" in key:
                    tensor.add_(0.2 * torch.randn_like(tensor))
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        saved[name] = (path, model)
    return saved


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_load_balancing_loss_match_transformers_and_export_round_trips(name, checkpoints, tmp_path):
    path, reference = checkpoints[name]
    model = load_pretrained(path)
    config = model.config
    assert (config.model_type, config.num_experts, config.num_experts_per_tok) == ("qwen3_moe", 6, 2)
    assert config.sparse_layers == {"mixed": (1,), "sparse": (0, 1)}[name]
    expected = torch_outputs(reference, output_router_logits=True)
    logits, stats = jppo_outputs(model)
    assert_match(logits, expected.logits.numpy())
    # transformers' aux loss over the unpadded tokens, from the stats the forward pass recorded
    ours = load_balancing_loss(stats.counts, stats.probs, stats.tokens, config.num_experts)
    np.testing.assert_allclose(ours, expected.aux_loss.item(), rtol=1e-6)
    assert np.all(stats.counts.sum(axis=-1) == 2 * left_padded_batch()[2].sum())  # dropless: k per valid token
    # the z-loss's numerators: sum of logsumexp(router logits)^2 over the unpadded tokens, per layer with experts,
    # from transformers' own router logits (float32: the sums agree to rounding)
    valid = left_padded_batch()[2].astype(bool).reshape(-1)
    z = [np.sum(torch.logsumexp(layer.double(), dim=-1).numpy()[valid] ** 2) for layer in expected.router_logits]
    np.testing.assert_allclose(stats.z, z, rtol=1e-5)

    save_pretrained(model, tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(reloaded) is type(reference)
    original = reference.state_dict()
    for key, tensor in reloaded.state_dict().items():
        torch.testing.assert_close(tensor, original[key], rtol=0, atol=0, msg=key)
    assert reloaded.config.mlp_only_layers == reference.config.mlp_only_layers
    assert reloaded.config.norm_topk_prob == reference.config.norm_topk_prob


def test_lora_on_a_model_with_experts_adapts_the_attention_projections_only(checkpoints):
    model = load_pretrained(checkpoints["mixed"][0])
    attach_lora(model, LoRAConfig(rank=4, alpha=8.0), seed=0)  # the default targets: attention and MLP
    adapters = model.decoder.layers.lora
    assert adapters.targets == ("q_proj", "k_proj", "v_proj", "o_proj")
    before = jppo_outputs(model)[0]
    for target in adapters.targets:  # B = 0 at first; a nonzero B changes the logits, and merging keeps them
        b = getattr(adapters, f"{target}_b")
        b.value = 0.05 * jax.random.normal(jax.random.key(1), b.shape)
    adapted = jppo_outputs(model)[0]
    assert np.abs(adapted - before).max() > 1e-3
    np.testing.assert_allclose(jppo_outputs(merged(model))[0], adapted, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="lora.target_modules"):
        attach_lora(load_pretrained(checkpoints["mixed"][0]), LoRAConfig(rank=4, target_modules=["up_proj"]), 0)
