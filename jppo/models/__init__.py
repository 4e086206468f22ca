"""Layer 3: the Flax NNX decoder with LM and value heads, KV cache, chunked log-probs and Hugging Face interop."""

from jppo.models.config import ModelConfig, RopeScaling
from jppo.models.decoder import CausalLM, PromptCache, ResponseCache, ValueModel
from jppo.models.families import MODEL_FAMILIES, Family
from jppo.models.hf import CheckpointError, load_pretrained, read_config, save_pretrained
from jppo.models.log_probs import token_log_probs
from jppo.models.sharding import create_model, param_shardings, partition_specs

__all__ = [
    "MODEL_FAMILIES",
    "CausalLM",
    "CheckpointError",
    "Family",
    "PromptCache",
    "ResponseCache",
    "ModelConfig",
    "RopeScaling",
    "ValueModel",
    "create_model",
    "load_pretrained",
    "read_config",
    "param_shardings",
    "partition_specs",
    "save_pretrained",
    "token_log_probs",
]
