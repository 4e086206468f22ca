"""Layer 3: the Flax NNX decoder with LM and value heads, KV cache, chunked log-probs and Hugging Face interop.

Each name loads from its submodule when first asked for (:func:`jppo.core.lazy.lazy_exports`): the config schema
composes :class:`~jppo.core.settings.LoRAConfig` without loading the decoder and the checkpoint readers.
"""

from jppo.core.lazy import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "config": ("ModelConfig", "RopeScaling"),
    "decoder": ("CausalLM",),
    "kv_cache": ("PromptCache", "ResponseCache"),
    "families": ("MODEL_FAMILIES", "Family"),
    "hf": ("CheckpointError", "load_pretrained", "read_config", "save_pretrained"),
    "log_probs": ("token_log_probs",),
    "sharding": ("create_model", "param_shardings", "partition_specs"),
    "value": ("ValueModel",),
})
