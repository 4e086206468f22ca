"""The decoder (embedding, stacked layers, final norm), its LM and value heads, and the KV cache.

One layer, pre-norm: ``h += o(attention(rope(q(n1(h))), rope(k(n1(h))), v(n1(h))))``, then
``h += swiglu(n2(h))``. The ``num_layers`` layers are stored stacked (leading ``layers`` axis) and run by one
``lax.scan``, so compile time does not grow with depth.

Attention rule, for packed training rows and cached decoding alike: the query in slot ``i`` attends key slot
``j`` iff ``j <= i`` and ``segment_ids[j] == segment_ids[i] != 0``. Positions are explicit (RoPE reads
``positions``), so left-padded prompts (padding segment 0, ``positions = cumsum(mask) - 1``) and packed rows
(segments 1, 2, ... with positions restarting at 0) are exact. Padding queries output finite values.

Parameter layout (``[in, out]`` kernels; attention projections flattened over heads, the flattened dimension
carries the heads' logical name, head-major as in Hugging Face checkpoints):

=====================================  ===================  ========================================
parameter                              shape                logical names
=====================================  ===================  ========================================
``decoder.embed_tokens``               ``[V, D]``           ``vocab, embed``
``decoder.layers.q_proj``              ``[L, D, H*E]``      ``layers, embed, q_heads``
``decoder.layers.k_proj`` / ``v_proj`` ``[L, D, K*E]``      ``layers, embed, kv_heads``
``decoder.layers.o_proj``              ``[L, H*E, D]``      ``layers, q_heads, embed``
``decoder.layers.{q,k,v}_bias``        ``[L, H*E | K*E]``   ``layers, q_heads | kv_heads``
``decoder.layers.o_bias``              ``[L, D]``           ``layers, -``
``decoder.layers.{q,k}_norm``          ``[L, E]``           ``layers, head_dim``
``decoder.layers.*_norm`` (D-wide)     ``[L, D]``           ``layers, -``
``decoder.layers.gate_proj``/``up``    ``[L, D, F]``        ``layers, embed, mlp``
``decoder.layers.down_proj``           ``[L, F, D]``        ``layers, mlp, embed``
``decoder.norm``                       ``[D]``              ``-``
``lm_head`` (untied only)              ``[D, V]``           ``embed, vocab``
``value_head.kernel`` / ``bias``       ``[D, 1]`` / ``[1]`` ``embed, value`` / ``value``
=====================================  ===================  ========================================
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct

from jppo.models.config import ModelConfig
from jppo.models.layers import apply_rope, attention, attention_mask, dense, rms_norm, rope_tables, swiglu, wide
from jppo.models.sharding import constrain, param, param_shardings

Array = jax.Array

HIDDEN = ("batch", "length", None)
CACHE = ("layers", "batch", "length", "kv_heads", "head_dim")


@struct.dataclass
class KVCache:
    """Keys and values of every layer for ``max_len`` slots per row, and the segment id of each slot.

    ``keys``/``values``: ``[num_layers, batch, max_len, num_kv_heads, head_dim]`` in the compute dtype, after
    RoPE; ``segment_ids``: ``[batch, max_len]`` int32, 0 for a slot never written (or padding).
    """

    keys: Array
    values: Array
    segment_ids: Array


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], config: ModelConfig) -> Array:
    return config.initializer_range * jax.random.normal(rngs.params(), shape, config.weight_dtype)


class DecoderLayers(nnx.Module):
    """``num_layers`` decoder layers with stacked weights, run by ``lax.scan``."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        L, D, F = config.num_layers, config.hidden_size, config.intermediate_size
        ones = lambda *shape: jnp.ones(shape, config.weight_dtype)  # noqa: E731
        zeros = lambda *shape: jnp.zeros(shape, config.weight_dtype)  # noqa: E731
        self.input_norm = param(ones(L, D), ("layers", None))
        self.q_proj = param(_normal(rngs, (L, D, config.q_size), config), ("layers", "embed", "q_heads"))
        self.k_proj = param(_normal(rngs, (L, D, config.kv_size), config), ("layers", "embed", "kv_heads"))
        self.v_proj = param(_normal(rngs, (L, D, config.kv_size), config), ("layers", "embed", "kv_heads"))
        self.o_proj = param(_normal(rngs, (L, config.q_size, D), config), ("layers", "q_heads", "embed"))
        with_bias, with_out_bias = config.attention_bias, config.attention_out_bias
        self.q_bias = param(zeros(L, config.q_size), ("layers", "q_heads")) if with_bias else None
        self.k_bias = param(zeros(L, config.kv_size), ("layers", "kv_heads")) if with_bias else None
        self.v_bias = param(zeros(L, config.kv_size), ("layers", "kv_heads")) if with_bias else None
        self.o_bias = param(zeros(L, D), ("layers", None)) if with_out_bias else None
        self.q_norm = param(ones(L, config.head_dim), ("layers", "head_dim")) if config.qk_norm else None
        self.k_norm = param(ones(L, config.head_dim), ("layers", "head_dim")) if config.qk_norm else None
        self.post_attention_norm = param(ones(L, D), ("layers", None))
        self.gate_proj = param(_normal(rngs, (L, D, F), config), ("layers", "embed", "mlp"))
        self.up_proj = param(_normal(rngs, (L, D, F), config), ("layers", "embed", "mlp"))
        self.down_proj = param(_normal(rngs, (L, F, D), config), ("layers", "mlp", "embed"))
        self.lora = None  # LoRA adapters (jppo.models.lora.attach_lora): y = x W + s (x A) B on their targets

    def _stacked_weights(self) -> dict[str, Array]:
        return {name: value[...] for name, value in vars(self).items() if isinstance(value, nnx.Param)}

    def __call__(
        self,
        hidden: Array,
        rope: tuple[Array, Array],
        mask: Array,
        cache: tuple[Array, Array] | None = None,
        cache_index: Array | int = 0,
    ) -> tuple[Array, tuple[Array, Array] | None]:
        """Runs all layers on ``hidden [B, T, D]``. With ``cache = (keys, values)`` each layer writes its new
        keys/values at slots ``[cache_index, cache_index + T)`` and attends over all slots (``mask [B, T, S]``)."""
        config = self.config
        dtype = config.compute_dtype
        batch, length, _ = hidden.shape
        cos, sin = rope

        scale = None if self.lora is None else self.lora.scale

        def linear(x: Array, weights: dict[str, Array], adapters: dict, name: str) -> Array:
            y = dense(x, weights[name].astype(dtype))
            if name in adapters:
                a, b = adapters[name]
                y = y + (scale * ((x @ a.astype(dtype)) @ b.astype(dtype))).astype(y.dtype)
            return y

        def project(x: Array, weights: dict[str, Array], adapters: dict, name: str, heads: int, logical: str) -> Array:
            y = linear(x, weights, adapters, f"{name}_proj")
            if weights.get(f"{name}_bias") is not None:
                y = y + weights[f"{name}_bias"].astype(dtype)
            y = constrain(y.reshape(batch, length, heads, config.head_dim), ("batch", "length", logical, None))
            if config.qk_norm and name in ("q", "k"):
                y = rms_norm(y, weights[f"{name}_norm"], config.rms_norm_eps)
            return y

        def layer(carry, inputs):
            h, layer_cache = carry
            weights, adapters, index = inputs
            x = rms_norm(h, weights["input_norm"], config.rms_norm_eps)
            q = apply_rope(project(x, weights, adapters, "q", config.num_heads, "q_heads"), cos, sin)
            k = apply_rope(project(x, weights, adapters, "k", config.num_kv_heads, "kv_heads"), cos, sin)
            v = project(x, weights, adapters, "v", config.num_kv_heads, "kv_heads")
            if layer_cache is not None:
                keys, values = (
                    jax.lax.dynamic_update_slice(stack, new[None].astype(stack.dtype), (index, 0, cache_index, 0, 0))
                    for stack, new in zip(layer_cache, (k, v))
                )
                layer_cache = (keys, values)
                k, v = keys[index], values[index]
            attended = attention(q, k, v, mask, config.attention).reshape(batch, length, config.q_size)
            out = linear(attended, weights, adapters, "o_proj")
            if weights.get("o_bias") is not None:
                out = out + weights["o_bias"].astype(dtype)
            h = h + out
            x = rms_norm(h, weights["post_attention_norm"], config.rms_norm_eps)
            if adapters:
                mlp = linear(jax.nn.silu(linear(x, weights, adapters, "gate_proj")) * linear(x, weights, adapters, "up_proj"),
                             weights, adapters, "down_proj")
            else:
                up, gate, down = (weights[name].astype(dtype) for name in ("up_proj", "gate_proj", "down_proj"))
                mlp = swiglu(x, gate, up, down)
            h = constrain(h + mlp, HIDDEN)
            return (h, layer_cache), None

        if config.remat:
            layer = jax.checkpoint(layer, prevent_cse=False)
        adapters = {} if self.lora is None else self.lora.stacked()
        inputs = (self._stacked_weights(), adapters, jnp.arange(config.num_layers))
        (hidden, cache), _ = jax.lax.scan(layer, (hidden, cache), inputs)
        return hidden, cache


class Decoder(nnx.Module):
    """Token embedding, the stacked layers and the final norm: ``input_ids -> hidden [B, T, D]``."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        embedding = _normal(rngs, (config.vocab_size, config.hidden_size), config)
        self.embed_tokens = param(embedding, ("vocab", "embed"))
        self.layers = DecoderLayers(config, rngs=rngs)
        self.norm = param(jnp.ones((config.hidden_size,), config.weight_dtype), (None,))

    def __call__(
        self,
        input_ids: Array,
        positions: Array | None = None,
        segment_ids: Array | None = None,
        cache: KVCache | None = None,
        cache_index: Array | int | None = None,
    ) -> tuple[Array, KVCache | None]:
        positions, segment_ids = _check_inputs(input_ids, positions, segment_ids)
        length = input_ids.shape[1]
        # the table gathered over "embed" (as FSDP does for any weight in use), still split by vocabulary: a
        # lookup straight from the (vocab, embed)-sharded table makes XLA replicate it whole
        embedding = constrain(self.embed_tokens[...].astype(self.config.compute_dtype), ("vocab", None))
        # clip: a padding id outside the vocabulary must not turn into NaN (jnp.take fills those with NaN)
        hidden = constrain(jnp.take(embedding, input_ids, axis=0, mode="clip"), HIDDEN)
        rope = rope_tables(positions, self.config)
        if cache is None:
            if cache_index is not None:
                raise ValueError("cache_index was given without a cache")
            mask = attention_mask(segment_ids, jnp.arange(length), segment_ids)
            hidden, _ = self.layers(hidden, rope, mask)
        else:
            cache_index = _check_cache_index(cache_index, length, cache)
            slots = jax.lax.dynamic_update_slice(cache.segment_ids, segment_ids, (0, cache_index))
            mask = attention_mask(segment_ids, cache_index + jnp.arange(length), slots)
            hidden, (keys, values) = self.layers(hidden, rope, mask, (cache.keys, cache.values), cache_index)
            cache = KVCache(keys=constrain(keys, CACHE), values=constrain(values, CACHE), segment_ids=slots)
        return rms_norm(hidden, self.norm[...], self.config.rms_norm_eps), cache

    def init_cache(self, batch_size: int, max_len: int) -> KVCache:
        config = self.config
        shape = (config.num_layers, batch_size, max_len, config.num_kv_heads, config.head_dim)
        keys, values = (constrain(jnp.zeros(shape, config.compute_dtype), CACHE) for _ in range(2))  # own buffers
        return KVCache(keys=keys, values=values, segment_ids=jnp.zeros((batch_size, max_len), jnp.int32))


def _check_inputs(input_ids: Array, positions: Array | None, segment_ids: Array | None) -> tuple[Array, Array]:
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(input_ids.shape[1], dtype=jnp.int32), input_ids.shape)
    if segment_ids is None:
        segment_ids = jnp.ones(input_ids.shape, jnp.int32)
    for name, array in (("positions", positions), ("segment_ids", segment_ids)):
        if array.shape != input_ids.shape:
            raise ValueError(
                f"{name} shape {tuple(array.shape)} does not match input_ids shape {tuple(input_ids.shape)}"
            )
    return positions, segment_ids.astype(jnp.int32)


def _check_cache_index(cache_index: Array | int | None, length: int, cache: KVCache) -> Array | int:
    max_len = cache.segment_ids.shape[1]
    cache_index = 0 if cache_index is None else cache_index
    if isinstance(cache_index, int) and not 0 <= cache_index <= max_len - length:
        # a traced index is not checked: dynamic_update_slice would clamp it and overwrite the last slots
        raise ValueError(f"cache_index={cache_index} + {length} tokens does not fit a cache of max_len={max_len}")
    return cache_index


class CausalLM(nnx.Module):
    """Policy (and reference) model: the decoder and a language-model head (tied to the embedding or not)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.decoder = Decoder(config, rngs=rngs)
        shape = (config.hidden_size, config.vocab_size)
        self.lm_head = None if config.tie_word_embeddings else param(_normal(rngs, shape, config), ("embed", "vocab"))

    def __call__(self, input_ids: Array, positions: Array | None = None, segment_ids: Array | None = None) -> Array:
        """Logits ``[B, T, V]`` float32. Defaults: ``positions = arange(T)``, ``segment_ids = 1`` (one sequence
        per row, no padding)."""
        hidden, _ = self.hidden_states(input_ids, positions, segment_ids)
        return self.logits(hidden)

    def hidden_states(
        self,
        input_ids: Array,
        positions: Array | None = None,
        segment_ids: Array | None = None,
        cache: KVCache | None = None,
        cache_index: Array | int | None = None,
    ) -> tuple[Array, KVCache | None]:
        """Final-norm hidden states ``[B, T, D]`` (compute dtype) and the updated cache (``None`` without one).

        With a cache, the ``T`` tokens are written at slots ``[cache_index, cache_index + T)`` of every row
        (``cache_index`` scalar, default 0) and each query attends to the cached slots up to its own that share
        its non-zero segment id.
        """
        return self.decoder(input_ids, positions, segment_ids, cache, cache_index)

    def logits(self, hidden: Array) -> Array:
        """``hidden [..., D] -> logits [..., V]`` in float32."""
        dtype = self.config.compute_dtype
        if self.lm_head is None:
            kernel = self.decoder.embed_tokens[...].astype(dtype).T
        else:
            kernel = self.lm_head[...].astype(dtype)
        logits = dense(hidden, kernel, preferred_element_type=wide(dtype))
        return constrain(logits, ("batch", "length", "vocab")) if logits.ndim == 3 else logits

    def init_cache(self, batch_size: int, max_len: int) -> KVCache:
        """An empty cache (zeros, every slot segment 0) for ``batch_size`` rows of ``max_len`` slots."""
        return self.decoder.init_cache(batch_size, max_len)


class ValueHead(nnx.Module):
    """``hidden [..., D] -> hidden w + b`` (float32 ``[...]``), initialised like transformers' score layer:
    ``w ~ N(0, initializer_range)``, ``b = 0``."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.kernel = param(_normal(rngs, (config.hidden_size, 1), config), ("embed", "value"))
        self.bias = param(jnp.zeros((1,), config.weight_dtype), ("value",))

    def __call__(self, hidden: Array) -> Array:
        kernel = self.kernel[...].astype(self.config.compute_dtype)
        values = jnp.einsum("...d,do->...o", hidden, kernel, preferred_element_type=wide(kernel.dtype))
        return (values + self.bias[...].astype(values.dtype))[..., 0]


class ValueModel(nnx.Module):
    """Critic: the same decoder with a scalar head, ``values [B, T]`` float32."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, decoder: Decoder | None = None):
        self.config = config
        self.decoder = Decoder(config, rngs=rngs) if decoder is None else decoder
        self.value_head = ValueHead(config, rngs=rngs)

    def __call__(self, input_ids: Array, positions: Array | None = None, segment_ids: Array | None = None) -> Array:
        hidden, _ = self.hidden_states(input_ids, positions, segment_ids)
        return self.value_head(hidden)

    def hidden_states(
        self, input_ids: Array, positions: Array | None = None, segment_ids: Array | None = None
    ) -> tuple[Array, None]:
        return self.decoder(input_ids, positions, segment_ids)

    @classmethod
    def from_policy(cls, policy: CausalLM, *, rngs: nnx.Rngs) -> ValueModel:
        """A critic whose decoder is a copy of ``policy``'s (own buffers, same shardings) and whose value head
        is new (verl initialises its critic from the policy checkpoint the same way). On a mesh the new head
        is placed on its own sharding there."""
        graphdef, state = nnx.split(policy.decoder)
        decoder = nnx.merge(graphdef, jax.tree.map(lambda array: array.copy(), state))
        model = cls(policy.config, rngs=rngs, decoder=decoder)
        sharding = policy.decoder.embed_tokens[...].sharding
        if isinstance(sharding, jax.sharding.NamedSharding):
            head = nnx.state(model.value_head)
            nnx.update(model.value_head, jax.device_put(head, param_shardings(head, sharding.mesh)))
        return model
