"""The decoder's configuration and its translation to and from a Hugging Face ``config.json``.

The families (llama, qwen2, qwen3) share one architecture and differ only in a few flags, which
:class:`ModelConfig` derives from ``model_type`` unless given; what each family fixes is its record in
:mod:`jppo.models.families` (the table of flags is there).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax.numpy as jnp

from jppo.core.errors import InvalidSetting
from jppo.models.families import MODEL_FAMILIES, Family

DTYPES: dict[str, jnp.dtype] = {
    "float32": jnp.dtype(jnp.float32),
    "bfloat16": jnp.dtype(jnp.bfloat16),
    "float16": jnp.dtype(jnp.float16),
    "float64": jnp.dtype(jnp.float64),  # exactness tests (needs jax_enable_x64)
}
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "llama3")
# How attention is computed (jppo.models.layers.attention): the masked float32 softmax, jax.nn.dot_product_attention
# lowered by XLA or by cuDNN, blocks in linear memory (jppo.models.attention), the Pallas flash kernels (splash on a
# TPU, Triton on a GPU; jppo.models.pallas_attention), or "auto" (jppo.models.layers.resolve_attention).
ATTENTION_IMPLEMENTATIONS: tuple[str, ...] = ("reference", "xla", "cudnn", "blockwise", "pallas", "auto")
ATTENTION_MIN_BLOCK = 8  # blocks have at least 8 tokens (the sublane tile of TPU and GPU kernels)
# How the layers run in forward and backward passes (DecoderLayers._scan): one rolled lax.scan, unrolled, or "auto".
LAYER_LOOPS: tuple[str, ...] = ("auto", "scan", "unroll")
# "auto" unrolls up to this depth: at 4 layers an unrolled actor update compiled as fast as the scan and stepped
# ~9% faster on CPU (the scan zero-fills and copies its stacked activations every step); at 24 layers it compiled
# in twice the time (bench/README.md, issue 15 after, "Update step").
AUTO_UNROLL_LAYERS = 8


def check_attention_blocks(block_q: Any, block_kv: Any) -> None:
    """Raises :class:`InvalidSetting` unless both block sizes fit the kernels' tiles: powers of two of at least
    :data:`ATTENTION_MIN_BLOCK` tokens (JAX's Triton lowering takes power-of-two tiles only; splash attention
    rounds a block up to its 128-token tiles, which powers of two from 128 on already are)."""
    for name, value in (("attention_block_q", block_q), ("attention_block_kv", block_kv)):
        if (not isinstance(value, int) or isinstance(value, bool) or value < ATTENTION_MIN_BLOCK
                or value & (value - 1)):
            raise InvalidSetting("", name, value, f"a power of two >= {ATTENTION_MIN_BLOCK} tokens (the GPU's "
                                 "Triton attention tiles are powers of two)")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 frequency scaling of RoPE (``rope_type: llama3``).

    With ``w = 2 pi / f`` the wavelength of an inverse frequency ``f`` and ``L`` the original context length:
    ``f`` is kept where ``w < L / high_freq_factor``, divided by ``factor`` where ``w > L / low_freq_factor``,
    and in between interpolated as ``(1 - s) f / factor + s f`` with
    ``s = (L / w - low_freq_factor) / (high_freq_factor - low_freq_factor)``.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        if self.factor <= 0:
            raise ValueError(f"rope_scaling.factor must be > 0, got {self.factor}")
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"rope_scaling.high_freq_factor={self.high_freq_factor} must exceed "
                f"rope_scaling.low_freq_factor={self.low_freq_factor}"
            )
        if self.original_max_position_embeddings <= 0:
            raise ValueError(
                "rope_scaling.original_max_position_embeddings must be > 0, "
                f"got {self.original_max_position_embeddings}"
            )

    @classmethod
    def from_dict(cls, scaling: Mapping[str, Any]) -> RopeScaling:
        rope_type = scaling.get("rope_type", scaling.get("type", "llama3"))
        if rope_type != "llama3":
            raise ValueError(
                f"unsupported rope_scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        fields = [field.name for field in dataclasses.fields(cls)]
        missing = [name for name in fields if name not in scaling]
        if missing:
            raise ValueError(f"rope_scaling (llama3) is missing {', '.join(missing)}; it needs {', '.join(fields)}")
        return cls(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )

    def to_dict(self) -> dict[str, Any]:
        return {"rope_type": "llama3", **dataclasses.asdict(self)}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder. Frozen and hashable, so it can be static in jit.

    ``head_dim`` defaults to ``hidden_size // num_heads`` and ``num_kv_heads`` to ``num_heads``. ``rope_scaling``
    accepts the Hugging Face dict (``{"rope_type": "llama3", "factor": ..., ...}``) and is stored as a
    :class:`RopeScaling`. ``dtype`` is the compute dtype, ``param_dtype`` the storage dtype of the weights
    (softmax, norms and logits are float32 either way). ``remat`` recomputes each layer in the backward pass
    instead of keeping its activations. ``attention`` picks how attention is computed (one of
    :data:`ATTENTION_IMPLEMENTATIONS`, see :func:`jppo.models.layers.attention`); ``attention_block_q`` and
    ``attention_block_kv`` are the query and key tokens per block of the ``blockwise`` and ``pallas`` ones
    (powers of two from :data:`ATTENTION_MIN_BLOCK`; a row shorter than a block is one block).
    ``layer_loop`` runs the layers of forward and backward passes as one ``lax.scan`` (``scan``: compile time
    independent of depth), unrolled (``unroll``: faster steps, compile time growing with depth) or ``auto``
    (unrolled up to :data:`AUTO_UNROLL_LAYERS` layers); the sampler's decoding steps are always unrolled. Token
    ids are carried only to write them back to ``config.json``.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | Mapping[str, Any] | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool | None = None
    attention_out_bias: bool | None = None
    qk_norm: bool | None = None
    max_position_embeddings: int = 2048
    dtype: str = "float32"
    param_dtype: str = "float32"
    model_type: str = "llama"
    initializer_range: float = 0.02
    remat: bool = False
    attention: str = "reference"
    attention_block_q: int = 512
    attention_block_kv: int = 512
    layer_loop: str = "auto"
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    # mixture of experts (qwen3_moe): num_experts > 0 puts a router and experts in the layers it names
    num_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    norm_topk_prob: bool = False
    router_aux_loss_coef: float = 0.0
    expert_chunk_size: int = 0  # tokens per device per round of the expert exchange (0: all in one round)

    def __post_init__(self) -> None:
        MODEL_FAMILIES.lookup(self.model_type)
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of {', '.join(DTYPES)}")
        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            raise InvalidSetting("", "attention", self.attention, f"one of {', '.join(ATTENTION_IMPLEMENTATIONS)}")
        check_attention_blocks(self.attention_block_q, self.attention_block_kv)
        if not (isinstance(self.expert_chunk_size, int) and self.expert_chunk_size >= 0):
            raise InvalidSetting("", "expert_chunk_size", self.expert_chunk_size, "an integer >= 0")
        if self.layer_loop not in LAYER_LOOPS:
            raise InvalidSetting("", "layer_loop", self.layer_loop, f"one of {', '.join(LAYER_LOOPS)}")
        if self.num_kv_heads is None:
            self._set("num_kv_heads", self.num_heads)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise InvalidSetting("", name, value, "a positive integer")
        if self.head_dim is None:
            if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 2:
                raise InvalidSetting(
                    "", "num_heads", self.num_heads,
                    f"a divisor of hidden_size={self.hidden_size} that leaves an even head size (RoPE rotates "
                    "pairs), unless head_dim is given",
                )
            self._set("head_dim", self.hidden_size // self.num_heads)
        if not isinstance(self.head_dim, int) or self.head_dim <= 0 or self.head_dim % 2:
            raise InvalidSetting("", "head_dim", self.head_dim, "a positive even integer (RoPE rotates pairs)")
        if self.num_heads % self.num_kv_heads:
            raise InvalidSetting("", "num_kv_heads", self.num_kv_heads, f"a divisor of num_heads={self.num_heads}")
        for name in ("rms_norm_eps", "rope_theta", "initializer_range"):
            if not getattr(self, name) > 0:
                raise InvalidSetting("", name, getattr(self, name), "> 0")
        if isinstance(self.rope_scaling, Mapping):
            self._set("rope_scaling", RopeScaling.from_dict(self.rope_scaling))
        if isinstance(self.eos_token_id, list):
            self._set("eos_token_id", tuple(self.eos_token_id))
        self._resolve_family_flags()
        self._check_experts()

    def _check_experts(self) -> None:
        self._set("mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
        outside = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
        if outside:
            raise InvalidSetting("", "mlp_only_layers", list(self.mlp_only_layers),
                                 f"layers in [0, num_layers={self.num_layers}) (not {outside})")
        if bool(self.num_experts) != self.family.has_experts:
            raise InvalidSetting("", "num_experts", self.num_experts, f"{'> 0' if self.family.has_experts else '0'} "
                                 f"for model_type {self.model_type!r}")
        if not self.num_experts:
            return
        for name in ("num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidSetting("", name, value, "a positive integer")
        if self.num_experts_per_tok > self.num_experts:
            raise InvalidSetting("", "num_experts_per_tok", self.num_experts_per_tok,
                                 f"<= num_experts={self.num_experts}")
        if not self.router_aux_loss_coef >= 0:
            raise InvalidSetting("", "router_aux_loss_coef", self.router_aux_loss_coef, ">= 0")

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # a default resolved while the frozen dataclass is being built

    def _resolve_family_flags(self) -> None:
        fixed = self.family.fixed_flags
        for name, value in fixed.items():
            given = getattr(self, name)
            if given is not None and given != value:
                raise ValueError(f"model_type {self.model_type!r} requires {name}={value}, got {name}={given}")
            self._set(name, value)
        if self.attention_bias is None:
            self._set("attention_bias", False)
        if self.attention_out_bias is None:
            self._set("attention_out_bias", self.attention_bias)
        if "attention_out_bias" not in fixed and self.attention_out_bias != self.attention_bias:
            raise ValueError(
                f"model_type {self.model_type!r} has one flag for q/k/v/o biases: attention_bias="
                f"{self.attention_bias} and attention_out_bias={self.attention_out_bias} must be equal"
            )

    @property
    def family(self) -> type[Family]:
        """The record of ``model_type`` in :data:`~jppo.models.families.MODEL_FAMILIES`."""
        return MODEL_FAMILIES[self.model_type]

    @property
    def compute_dtype(self) -> jnp.dtype:
        return DTYPES[self.dtype]

    @property
    def weight_dtype(self) -> jnp.dtype:
        return DTYPES[self.param_dtype]

    @property
    def resolved_layer_loop(self) -> str:
        """``scan`` or ``unroll``: what ``layer_loop`` means for this depth."""
        if self.layer_loop != "auto":
            return self.layer_loop
        return "unroll" if self.num_layers <= AUTO_UNROLL_LAYERS else "scan"

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        """The layers with a router and experts (transformers' rule: not in ``mlp_only_layers`` and ``(i + 1)``
        a multiple of ``decoder_sparse_step``); none without experts."""
        if not self.num_experts:
            return ()
        return tuple(i for i in range(self.num_layers)
                     if i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def dense_layers(self) -> tuple[int, ...]:
        """The layers with the dense SwiGLU MLP (every layer of a model without experts)."""
        sparse = set(self.sparse_layers)
        return tuple(i for i in range(self.num_layers) if i not in sparse)

    @property
    def q_size(self) -> int:
        """Width of the flattened query projection, ``num_heads * head_dim``."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of each flattened key/value projection, ``num_kv_heads * head_dim``."""
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], **overrides: Any) -> ModelConfig:
        """Reads a Hugging Face ``config.json`` dict (transformers 4.x ``rope_theta``/``rope_scaling`` or 5.x
        ``rope_parameters``). ``overrides`` set jppo-only fields such as ``dtype``, ``param_dtype``, ``remat``,
        ``attention``, ``attention_block_q``, ``attention_block_kv``, ``layer_loop``, ``expert_chunk_size``.

        Raises ``ValueError`` for families or features this decoder does not implement (naming them).
        """
        model_type = hf.get("model_type")
        family = MODEL_FAMILIES.lookup(model_type)
        unsupported = {
            "hidden_act": (hf.get("hidden_act", "silu"), "silu"),
            "mlp_bias": (bool(hf.get("mlp_bias", False)), False),
            "use_sliding_window": (bool(hf.get("use_sliding_window", False)), False),
            "partial_rotary_factor": (hf.get("partial_rotary_factor", 1.0), 1.0),
        }
        for key, (found, supported) in unsupported.items():
            if found != supported:
                raise ValueError(f"config.json {key}={found!r} is not supported (only {supported!r})")
        rope_theta, rope_scaling = _read_rope(hf)
        head_dim = hf.get("head_dim") or family.default_head_dim
        eos = hf.get("eos_token_id")
        fields = dict(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=head_dim,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=None if "attention_bias" in family.fixed_flags else bool(hf.get("attention_bias", False)),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            model_type=model_type,
            initializer_range=hf.get("initializer_range", 0.02),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            pad_token_id=hf.get("pad_token_id"),
        )
        if family.has_experts:
            # transformers 5 writes num_experts as num_local_experts; the published checkpoints say num_experts
            fields.update(
                num_experts=hf.get("num_experts", hf.get("num_local_experts")),
                num_experts_per_tok=hf["num_experts_per_tok"],
                moe_intermediate_size=hf["moe_intermediate_size"],
                decoder_sparse_step=hf.get("decoder_sparse_step", 1),
                mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
            )
        return cls(**{**fields, **overrides})

    def to_hf(self, head: str = "lm") -> dict[str, Any]:
        """A ``config.json`` dict that transformers 4.45+ and 5.x load: ``head="lm"`` as ``*ForCausalLM``,
        ``head="value"`` as ``*ForTokenClassification`` with one label (verl's critic layout)."""
        suffix = {"lm": "ForCausalLM", "value": "ForTokenClassification"}
        if head not in suffix:
            raise ValueError(f"unknown head {head!r}; valid: {', '.join(suffix)}")
        scaling = self.rope_scaling.to_dict() if self.rope_scaling is not None else None
        hf: dict[str, Any] = {
            "architectures": [self.family.hf_architecture + suffix[head]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            # both spellings: transformers 4.x reads rope_theta/rope_scaling, 5.x rope_parameters
            "rope_theta": self.rope_theta,
            "rope_scaling": scaling,
            "rope_parameters": {"rope_theta": self.rope_theta, **(scaling or {"rope_type": "default"})},
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": self.initializer_range,
            "dtype": self.param_dtype,
            "use_cache": True,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }
        if "attention_bias" not in self.family.fixed_flags:
            hf["attention_bias"] = self.attention_bias
        hf.update(self.family.hf_constants)
        if self.num_experts:
            hf.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                      moe_intermediate_size=self.moe_intermediate_size, decoder_sparse_step=self.decoder_sparse_step,
                      mlp_only_layers=list(self.mlp_only_layers), norm_topk_prob=self.norm_topk_prob,
                      router_aux_loss_coef=self.router_aux_loss_coef, output_router_logits=False)
        if head == "value":
            hf["id2label"] = {"0": "LABEL_0"}
            hf["label2id"] = {"LABEL_0": 0}
        return hf


def _read_rope(hf: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, rope_scaling)`` from either config.json spelling."""
    parameters = hf.get("rope_parameters") or {}
    if parameters and not isinstance(parameters.get("rope_theta", 0.0), (int, float)):
        raise ValueError("per-layer rope_parameters are not supported")
    theta = float(parameters.get("rope_theta", hf.get("rope_theta", 10000.0)))
    scaling = hf.get("rope_scaling") or parameters
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    return theta, (RopeScaling.from_dict(scaling) if rope_type == "llama3" else None)
