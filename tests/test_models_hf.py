"""Hugging Face interop against transformers (torch CPU, float32): logits parity, round trips, sharded and
bfloat16 checkpoints, value heads, config translation and checkpoint errors."""

import functools
import json
import shutil

import jax
import numpy as np
import pytest
import safetensors.torch
import torch
import transformers
from flax import nnx

from jppo.models import CausalLM, CheckpointError, ModelConfig, ValueModel, load_pretrained, save_pretrained

SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)
# original context 64 puts RoPE wavelengths (6.3 ... 6e4 for head size 16) in all three Llama-3 bands
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
FAMILIES = {
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SIZES)),
    # with attention_bias: q/k/v and o_proj biases (Qwen2 has no o_proj bias)
    "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=16, attention_bias=True, **SIZES)),
    "llama": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(tie_word_embeddings=True, rope_scaling=LLAMA3_ROPE, **SIZES)
    ),
}
# float32 on both sides; the two differ in summation order and in how RoPE angles are rounded
RELATIVE_TOLERANCE = 1e-4


def left_padded_batch():
    mask = np.array([[0, 0, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 1, 1, 1]])
    ids = np.random.default_rng(0).integers(0, SIZES["vocab_size"], mask.shape)
    positions = np.maximum(mask.cumsum(axis=1) - 1, 0)
    return ids, positions, mask


def torch_outputs(model: torch.nn.Module) -> np.ndarray:
    ids, positions, mask = left_padded_batch()
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                     position_ids=torch.tensor(positions)).logits.numpy()


@functools.partial(jax.jit, static_argnums=0)
def _apply(graphdef, state, ids, positions, mask):
    return nnx.merge(graphdef, state)(ids, positions, mask)


def jppo_outputs(model: CausalLM | ValueModel) -> np.ndarray:
    graphdef, state = nnx.split(model)
    return np.asarray(_apply(graphdef, state, *left_padded_batch()))


def assert_match(actual: np.ndarray, expected: np.ndarray, tolerance: float = RELATIVE_TOLERANCE):
    valid = left_padded_batch()[2].astype(bool)
    error = np.abs(actual - expected)[valid].max() / np.abs(expected[valid]).max()
    assert error < tolerance, error


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (directory of a saved random transformers model, that model)."""
    saved = {}
    for family, build in FAMILIES.items():
        torch.manual_seed(0)
        model = build().eval()
        with torch.no_grad():  # norms and biases away from 1 and 0, so that each of them matters
            for name, tensor in model.named_parameters():
                if "norm" in name or "bias" in name:
                    tensor.add_(0.2 * torch.randn_like(tensor))
        path = tmp_path_factory.mktemp(family)
        model.save_pretrained(path)
        saved[family] = (path, model)
    return saved


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers_and_round_trip(family, checkpoints, tmp_path):
    path, reference = checkpoints[family]
    model = load_pretrained(path)
    assert model.config.model_type == family
    expected = torch_outputs(reference)
    assert_match(jppo_outputs(model), expected)

    save_pretrained(model, tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(reloaded) is type(reference)
    original = reference.state_dict()
    for name, tensor in reloaded.state_dict().items():
        torch.testing.assert_close(tensor, original[name], rtol=0, atol=0, msg=name)
    assert_match(torch_outputs(reloaded), expected, tolerance=1e-6)  # same weights, same program


def test_sharded_index_checkpoint_loads_the_same_parameters(checkpoints, tmp_path):
    path, reference = checkpoints["qwen2"]
    reference.save_pretrained(tmp_path, max_shard_size="40KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 2 and (tmp_path / "model.safetensors.index.json").exists()
    for got, want in zip(jax.tree.leaves(nnx.state(load_pretrained(tmp_path))),
                         jax.tree.leaves(nnx.state(load_pretrained(path)))):
        np.testing.assert_array_equal(got, want)


def test_bfloat16_checkpoints_load_exactly_and_save_in_the_parameter_dtype(checkpoints, tmp_path):
    _, reference = checkpoints["qwen3"]
    reference.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    reference.to(torch.float32)
    embedding = reference.state_dict()["model.embed_tokens.weight"].to(torch.bfloat16)
    as_float32 = load_pretrained(tmp_path / "bf16")
    np.testing.assert_array_equal(as_float32.decoder.embed_tokens[...], embedding.float().numpy())
    as_bfloat16 = load_pretrained(tmp_path / "bf16", param_dtype="bfloat16", dtype="bfloat16")
    assert as_bfloat16.decoder.layers.q_proj[...].dtype == jax.numpy.bfloat16
    save_pretrained(as_bfloat16, tmp_path / "out")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype="auto")
    assert reloaded.model.embed_tokens.weight.dtype == torch.bfloat16
    torch.testing.assert_close(reloaded.model.embed_tokens.weight, embedding, rtol=0, atol=0)


def test_value_model_from_policy_checkpoint_then_as_critic_checkpoint(checkpoints, tmp_path):
    path, _ = checkpoints["qwen2"]
    critic = load_pretrained(path, head="value", seed=3)
    policy = load_pretrained(path)

    @nnx.jit
    def hidden(policy, critic):
        ids, positions, mask = left_padded_batch()
        return policy.hidden_states(ids, positions, mask), critic.hidden_states(ids, positions, mask)

    policy_hidden, critic_hidden = hidden(policy, critic)
    np.testing.assert_array_equal(critic_hidden, policy_hidden)
    assert np.abs(np.asarray(critic.value_head.kernel[...])).max() > 0  # a new head, not zeros

    save_pretrained(critic, tmp_path)
    reference = transformers.AutoModelForTokenClassification.from_pretrained(tmp_path).eval()
    assert type(reference).__name__ == "Qwen2ForTokenClassification" and reference.config.num_labels == 1
    assert_match(jppo_outputs(critic)[..., None], torch_outputs(reference))
    reloaded = load_pretrained(tmp_path, head="value")  # a critic checkpoint: its score layer is the head
    np.testing.assert_array_equal(reloaded.value_head.kernel[...], critic.value_head.kernel[...])
    np.testing.assert_array_equal(reloaded.value_head.bias[...], critic.value_head.bias[...])


def copy_checkpoint(checkpoints, tmp_path, family="qwen2"):
    shutil.copytree(checkpoints[family][0], tmp_path, dirs_exist_ok=True)
    return tmp_path


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **changes}))


def test_missing_tensor_is_named(checkpoints, tmp_path):
    path = copy_checkpoint(checkpoints, tmp_path)
    tensors = safetensors.torch.load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    safetensors.torch.save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.1\.mlp\.up_proj\.weight"):
        load_pretrained(path)


def test_shape_mismatch_names_tensor_and_shapes(checkpoints, tmp_path):
    path = copy_checkpoint(checkpoints, tmp_path)
    edit_config(path, intermediate_size=80)
    with pytest.raises(CheckpointError, match=r"mlp\.down_proj\.weight: expected shape \(64, 80\), found \(64, 96\)"):
        load_pretrained(path)


def test_unsupported_model_type_names_it_and_the_supported_ones(checkpoints, tmp_path):
    path = copy_checkpoint(checkpoints, tmp_path)
    edit_config(path, model_type="gpt2")
    with pytest.raises(CheckpointError, match="unsupported model_type 'gpt2'; supported: llama, qwen2, qwen3"):
        load_pretrained(path)


def test_missing_files_are_named(checkpoints, tmp_path):
    with pytest.raises(CheckpointError, match="missing config.json"):
        load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(checkpoints["qwen2"][1].config.to_dict()))
    with pytest.raises(CheckpointError, match="neither model.safetensors nor model.safetensors.index.json"):
        load_pretrained(tmp_path)
    with pytest.raises(ValueError, match="unknown head 'reward'; valid: lm, value"):
        load_pretrained(tmp_path, head="reward")


def test_config_translation_reads_both_rope_spellings_and_rejects_unsupported_features():
    v4_style = dict(model_type="llama", vocab_size=32, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, rope_theta=5e5,
                    rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 64})
    config = ModelConfig.from_hf(v4_style, dtype="bfloat16")
    assert (config.rope_theta, config.rope_scaling.factor, config.num_kv_heads, config.head_dim) == (5e5, 8.0, 4, 16)
    assert config.dtype == "bfloat16" and config.param_dtype == "float32"
    assert ModelConfig.from_hf(config.to_hf(), dtype="bfloat16") == config  # the compute dtype is jppo's own
    v5_style = {**v4_style, "rope_theta": None, "rope_scaling": None,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    assert ModelConfig.from_hf(v5_style).rope_theta == 1e6 and ModelConfig.from_hf(v5_style).rope_scaling is None
    hf = transformers.AutoConfig.for_model(**config.to_hf())
    assert hf.rope_parameters["rope_type"] == "llama3" and hf.num_key_value_heads == 4
    qwen3 = {**v4_style, "model_type": "qwen3", "rope_scaling": None}
    assert ModelConfig.from_hf(qwen3).head_dim == 128  # transformers' Qwen3 default when config.json omits it
    for changes, message in [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope type 'yarn'"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        ({"mlp_bias": True}, "mlp_bias=True is not supported"),
        ({"model_type": "mistral"}, "unsupported model_type 'mistral'"),
    ]:
        with pytest.raises(ValueError, match=message):
            ModelConfig.from_hf({**v4_style, **changes})
