"""The model families the decoder reads and writes: one registered record per Hugging Face ``model_type``.

Three families share one architecture (pre-norm decoder, RMSNorm, rotary positions, grouped-query attention,
SwiGLU MLP) and differ only in a few flags, which :class:`~jppo.models.config.ModelConfig` derives from
``model_type`` unless given:

========  =======================  ==========================  =============================
family    ``attention_bias``       ``attention_out_bias``      ``qk_norm``
========  =======================  ==========================  =============================
llama     config (default False)   same as ``attention_bias``  False
qwen2     True (q/k/v biases)      False                       False
qwen3     config (default False)   same as ``attention_bias``  True (RMSNorm of q, k per head)
========  =======================  ==========================  =============================

``qwen3_moe`` is qwen3's attention with a mixture of experts in the MLP of the layers it names
(:attr:`~jppo.models.config.ModelConfig.sparse_layers`): a softmax top-k router and SwiGLU experts, stored
per expert in the checkpoints (``mlp.experts.{j}.gate_proj.weight``, ..., ``mlp.gate.weight``).

A family is a :class:`Family` subclass decorated with ``@MODEL_FAMILIES.register(model_type)``; its attributes
are all that :mod:`jppo.models.config` (flags, ``config.json``) and :mod:`jppo.models.hf` (tensor names) know of
it.
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

from jppo.core.registry import Registry

MODEL_FAMILIES: Registry[type[Family]] = Registry(
    "model_type", lambda name, names: f"unsupported model_type {name!r}; supported: {', '.join(names)}"
)

_LAYER = "model.layers.{i}."
# Llama, Qwen2 and Qwen3 name their tensors identically; a model uses the entries its config gives it
# parameters for (q/k/v biases: Qwen2 or attention_bias; q_norm/k_norm: Qwen3; lm_head: untied embeddings).
_SHARED_NAMES: dict[str, tuple[str, bool]] = {
    "decoder.embed_tokens": ("model.embed_tokens.weight", False),
    "decoder.norm": ("model.norm.weight", False),
    "decoder.layers.input_norm": (_LAYER + "input_layernorm.weight", False),
    "decoder.layers.q_proj": (_LAYER + "self_attn.q_proj.weight", True),
    "decoder.layers.k_proj": (_LAYER + "self_attn.k_proj.weight", True),
    "decoder.layers.v_proj": (_LAYER + "self_attn.v_proj.weight", True),
    "decoder.layers.o_proj": (_LAYER + "self_attn.o_proj.weight", True),
    "decoder.layers.q_bias": (_LAYER + "self_attn.q_proj.bias", False),
    "decoder.layers.k_bias": (_LAYER + "self_attn.k_proj.bias", False),
    "decoder.layers.v_bias": (_LAYER + "self_attn.v_proj.bias", False),
    "decoder.layers.o_bias": (_LAYER + "self_attn.o_proj.bias", False),
    "decoder.layers.q_norm": (_LAYER + "self_attn.q_norm.weight", False),
    "decoder.layers.k_norm": (_LAYER + "self_attn.k_norm.weight", False),
    "decoder.layers.post_attention_norm": (_LAYER + "post_attention_layernorm.weight", False),
    "decoder.layers.gate_proj": (_LAYER + "mlp.gate_proj.weight", True),
    "decoder.layers.up_proj": (_LAYER + "mlp.up_proj.weight", True),
    "decoder.layers.down_proj": (_LAYER + "mlp.down_proj.weight", True),
    "lm_head": ("lm_head.weight", True),
    # transformers' *ForTokenClassification with one label: verl's critic checkpoints
    "value_head.kernel": ("score.weight", True),
    "value_head.bias": ("score.bias", False),
}
# a mixture of experts' router and experts, in the layers with experts ({j}: the expert)
_EXPERT_NAMES: dict[str, tuple[str, bool]] = {
    "decoder.layers.router": (_LAYER + "mlp.gate.weight", True),
    "decoder.layers.expert_gate": (_LAYER + "mlp.experts.{j}.gate_proj.weight", True),
    "decoder.layers.expert_up": (_LAYER + "mlp.experts.{j}.up_proj.weight", True),
    "decoder.layers.expert_down": (_LAYER + "mlp.experts.{j}.down_proj.weight", True),
}


class Family:
    """What one family sets apart (class attributes; a family is never instantiated).

    Attributes:
        hf_architecture: transformers' class prefix (``Llama``: ``LlamaForCausalLM``, ``LlamaForTokenClassification``).
        fixed_flags: the :class:`~jppo.models.config.ModelConfig` flags the family fixes (a config giving another
            value is refused). A fixed ``attention_bias`` is neither read from nor written to ``config.json``; a
            family that does not fix ``attention_out_bias`` has one flag, ``attention_bias``, for the q/k/v/o biases.
        hf_constants: ``config.json`` keys the family writes with a fixed value.
        default_head_dim: the head size where a ``config.json`` leaves it out (transformers' own default); ``None``:
            ``hidden_size // num_heads``.
        tensor_names: jppo parameter path -> (Hugging Face tensor name, with ``{i}`` for the layer and ``{j}`` for
            the expert, transposed or not): the only place that knows the correspondence (:mod:`jppo.models.hf`).
        has_experts: the family's layers may hold a mixture of experts (``num_experts > 0``).
    """

    hf_architecture: ClassVar[str]
    fixed_flags: ClassVar[Mapping[str, bool]] = {}
    hf_constants: ClassVar[Mapping[str, Any]] = {}
    default_head_dim: ClassVar[int | None] = None
    tensor_names: ClassVar[Mapping[str, tuple[str, bool]]] = _SHARED_NAMES
    has_experts: ClassVar[bool] = False


@MODEL_FAMILIES.register("llama")
class Llama(Family):
    hf_architecture = "Llama"
    fixed_flags = {"qk_norm": False}
    hf_constants = {"mlp_bias": False}


@MODEL_FAMILIES.register("qwen2")
class Qwen2(Family):
    hf_architecture = "Qwen2"
    fixed_flags = {"attention_bias": True, "attention_out_bias": False, "qk_norm": False}
    hf_constants = {"use_sliding_window": False}


@MODEL_FAMILIES.register("qwen3")
class Qwen3(Family):
    hf_architecture = "Qwen3"
    fixed_flags = {"qk_norm": True}
    default_head_dim = 128


@MODEL_FAMILIES.register("qwen3_moe")
class Qwen3Moe(Family):
    hf_architecture = "Qwen3Moe"
    fixed_flags = {"qk_norm": True}
    hf_constants = {"use_sliding_window": False}
    tensor_names = {**_SHARED_NAMES, **_EXPERT_NAMES}
    has_experts = True
