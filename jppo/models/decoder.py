"""The decoder (embedding, stacked layers, final norm), its LM head, and the sampler's caches (the critic's value
head on the same decoder: :mod:`jppo.models.value`).

One layer, pre-norm: ``h += o(attention(rope(q(n1(h))), rope(k(n1(h))), v(n1(h))))``, then
``h += down(silu(gate(n2(h))) * up(n2(h)))``. The ``num_layers`` layers are stored stacked (leading ``layers``
axis) and run by one ``lax.scan``, so compile time does not grow with depth; decoding one token per row unrolls
them instead, over per-layer caches (:meth:`DecoderLayers.decode` says why); bitwise: :mod:`jppo.models.bitwise`.

Attention rule, for packed training rows and cached decoding alike: the query in slot ``i`` attends key slot
``j`` iff ``j <= i`` and ``segment_ids[j] == segment_ids[i] != 0``. Positions are explicit (RoPE reads
``positions``), so left-padded prompts (padding segment 0, ``positions = cumsum(mask) - 1``) and packed rows
(segments 1, 2, ... with positions restarting at 0) are exact. Padding queries output finite values.

The parameter layout, each tensor's shape and logical axis names: :mod:`jppo.models.sharding`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jppo.models.attention import AttentionRule, by_product
from jppo.models.bitwise import experts_each  # noqa: I001
from jppo.models.bitwise import forward as bitwise_forward
from jppo.models.config import ModelConfig
from jppo.models.context import context_parallel, sequence_attention
from jppo.models.kv_cache import (
    PromptCache,
    ResponseCache,
    cache_rows,
    lane_group,
    layer_copier,
    with_decoding_copies,
    write_slot,
)
from jppo.models.layers import (
    RESPONSE_BLOCKS,
    apply_rope,
    attention,
    check_inputs,
    decode_attention,
    dense,
    response_blocks,
    rms_norm,
    rope_tables,
    wide,
)
from jppo.models.moe import expert_params, layer_slices, moe_mlp, record_routing, run_layers
from jppo.models.sharding import constrain, constrain_gradient, logical_names, param

Array = jax.Array

HIDDEN = ("batch", "length", None)
CACHE = ("batch", "kv_heads", "length", "head_dim")


def normal_weights(rngs: nnx.Rngs, shape: tuple[int, ...], config: ModelConfig) -> Array:
    """New weights ``~ N(0, initializer_range)`` in the weight dtype: every kernel of the decoder and its heads."""
    return config.initializer_range * jax.random.normal(rngs.params(), shape, config.weight_dtype)


class DecoderLayers(nnx.Module):
    """``num_layers`` decoder layers with stacked weights, run by ``lax.scan``."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        L, D, F = config.num_layers, config.hidden_size, config.intermediate_size
        ones = lambda *shape: jnp.ones(shape, config.weight_dtype)  # noqa: E731
        zeros = lambda *shape: jnp.zeros(shape, config.weight_dtype)  # noqa: E731
        self.input_norm = param(ones(L, D), ("layers", None))
        self.q_proj = param(normal_weights(rngs, (L, D, config.q_size), config), ("layers", "embed", "q_heads"))
        self.k_proj = param(normal_weights(rngs, (L, D, config.kv_size), config), ("layers", "embed", "kv_heads"))
        self.v_proj = param(normal_weights(rngs, (L, D, config.kv_size), config), ("layers", "embed", "kv_heads"))
        self.o_proj = param(normal_weights(rngs, (L, config.q_size, D), config), ("layers", "q_heads", "embed"))
        with_bias, with_out_bias = config.attention_bias, config.attention_out_bias
        self.q_bias = param(zeros(L, config.q_size), ("layers", "q_heads")) if with_bias else None
        self.k_bias = param(zeros(L, config.kv_size), ("layers", "kv_heads")) if with_bias else None
        self.v_bias = param(zeros(L, config.kv_size), ("layers", "kv_heads")) if with_bias else None
        self.o_bias = param(zeros(L, D), ("layers", None)) if with_out_bias else None
        self.q_norm = param(ones(L, config.head_dim), ("layers", "head_dim")) if config.qk_norm else None
        self.k_norm = param(ones(L, config.head_dim), ("layers", "head_dim")) if config.qk_norm else None
        self.post_attention_norm = param(ones(L, D), ("layers", None))
        Ld = len(config.dense_layers)  # the dense MLP's layers; the others hold experts (jppo.models.moe)
        dense = Ld > 0
        self.gate_proj = param(normal_weights(rngs, (Ld, D, F), config), ("layers", "embed", "mlp")) if dense else None
        self.up_proj = param(normal_weights(rngs, (Ld, D, F), config), ("layers", "embed", "mlp")) if dense else None
        self.down_proj = param(normal_weights(rngs, (Ld, F, D), config), ("layers", "mlp", "embed")) if dense else None
        experts = expert_params(config, lambda shape: normal_weights(rngs, shape, config))
        self.router, self.expert_gate, self.expert_up, self.expert_down = (
            param(value, names) if value is not None else None for value, names in experts)
        self.lora = None  # LoRA adapters (jppo.models.lora.attach_lora): y = x W + s (x A) B on their targets

    def _stacked_weights(self) -> dict[str, Array]:
        return {name: value[...] for name, value in vars(self).items() if isinstance(value, nnx.Param)}

    def _stacked_adapters(self) -> dict[str, tuple[Array, Array]]:
        return {} if self.lora is None else self.lora.stacked()

    def _linear(self, x: Array, weights: dict, adapters: dict, name: str) -> Array:
        """``x @ W_name`` in the compute dtype, plus its LoRA adapter's ``s (x A) B`` if it has one."""
        dtype = self.config.compute_dtype
        y = dense(x, weights[name].astype(dtype))
        if name in adapters:
            a, b = adapters[name]
            y = y + (self.lora.scale * ((x @ a.astype(dtype)) @ b.astype(dtype))).astype(y.dtype)
        return y

    def _qkv(self, h: Array, weights: dict, adapters: dict, rope: tuple[Array, Array]) -> tuple[Array, Array, Array]:
        """A layer's queries, keys and values ``[B, T, heads, E]`` of ``h [B, T, D]`` (normed, projected, RoPE)."""
        config = self.config
        batch, length, _ = h.shape

        def project(x: Array, name: str, heads: int, logical: str) -> Array:
            y = self._linear(x, weights, adapters, f"{name}_proj")
            if weights.get(f"{name}_bias") is not None:
                y = y + weights[f"{name}_bias"].astype(config.compute_dtype)
            y = constrain(y.reshape(batch, length, heads, config.head_dim), ("batch", "length", logical, None))
            if config.qk_norm and name in ("q", "k"):
                y = rms_norm(y, weights[f"{name}_norm"], config.rms_norm_eps)
            return y

        x = rms_norm(h, weights["input_norm"], config.rms_norm_eps)
        q = apply_rope(project(x, "q", config.num_heads, "q_heads"), *rope)
        k = apply_rope(project(x, "k", config.num_kv_heads, "kv_heads"), *rope)
        return q, k, project(x, "v", config.num_kv_heads, "kv_heads")

    def _after_attention(self, h: Array, attended: Array, weights: dict, adapters: dict, valid: Array | None = None,
                         replay: Array | None = None) -> tuple[Array, Any]:
        """The rest of a layer from the attended values ``[B, T, H, E]``: output projection and residual, then the
        MLP (or experts: their stats and experts come back, else None) and residual."""
        config = self.config
        batch, length, _ = h.shape
        out = self._linear(attended.reshape(batch, length, config.q_size), weights, adapters, "o_proj")
        if weights.get("o_bias") is not None:
            out = out + weights["o_bias"].astype(config.compute_dtype)
        h = h + out
        x = rms_norm(h, weights["post_attention_norm"], config.rms_norm_eps)
        if "router" in weights:
            valid = jnp.ones((batch, length), bool) if valid is None else valid
            mixture = experts_each if by_product() else moe_mlp  # bitwise: every expert on every token
            mlp, stats, experts = mixture(x, valid, weights["router"], weights["expert_gate"], weights["expert_up"],
                                          weights["expert_down"], config.num_experts_per_tok, config.norm_topk_prob,
                                          replay, chunk=config.expert_chunk_size)
            return constrain(h + mlp, HIDDEN), (stats, experts)
        linear = lambda x, name: self._linear(x, weights, adapters, name)  # noqa: E731
        mlp = linear(jax.nn.silu(linear(x, "gate_proj")) * linear(x, "up_proj"), "down_proj")  # SwiGLU
        return constrain(h + mlp, HIDDEN), None

    def _block(self, h: Array, weights: dict, adapters: dict, rope: tuple[Array, Array], attend,
               valid: Array | None = None, replay: Array | None = None) -> tuple[Array, Any]:
        """One layer on ``h [B, T, D]`` (its ``weights``, LoRA ``adapters``); ``attend(q, k, v)`` returns the
        attended values and anything the caller wants back (keys and values, a cache). A layer with experts also
        returns its :class:`~jppo.models.moe.RouterStats` over the ``valid [B, T]`` tokens and its experts
        ``[B, T, k]`` (routing by ``replay`` if given): ``(extra, (stats, experts))``."""
        attended, extra = attend(*self._qkv(h, weights, adapters, rope))
        h, routed = self._after_attention(h, attended, weights, adapters, valid, replay)
        return (h, extra) if routed is None else (h, (extra, routed))

    def _scan(self, hidden: Array, rope: tuple[Array, Array], attend, valid: Array | None = None
              ) -> tuple[Array, Any]:
        """All layers by :func:`~jppo.models.moe.run_layers` (one ``lax.scan``, rolled or unrolled by
        ``layer_loop``; layers with and without experts one after the other), every layer's ``extra`` stacked."""
        names = {name: logical_names(value)[1:] for name, value in vars(self).items() if isinstance(value, nnx.Param)}

        def layer(h, inputs):  # each layer's weight gradient split over fsdp as it is made (constrain_gradient)
            weights = {name: constrain_gradient(w, names[name]) for name, w in inputs[0].items()}
            return self._block(h, weights, inputs[1], rope, attend, valid, inputs[2])

        if self.config.remat:
            layer = jax.checkpoint(layer, prevent_cse=False)
        return run_layers(layer, hidden, self._stacked_weights(), self._stacked_adapters(), self.config)

    def _attention(self, q: Array, k: Array, v: Array, rule: AttentionRule) -> Array:
        config = self.config
        return attention(q, k, v, rule, config.attention, (config.attention_block_q, config.attention_block_kv))

    def __call__(self, hidden: Array, rope: tuple[Array, Array], rule: AttentionRule) -> Array:
        """Runs all layers on ``hidden [B, T, D]``, each query attending the keys its ``rule`` shows it."""
        attend = lambda q, k, v: (self._attention(q, k, v, rule), None)  # noqa: E731
        return self._scan(hidden, rope, attend, rule.query_segments != 0)[0]

    def context_parallel(self, hidden: Array, rope: tuple[Array, Array], segment_ids: Array) -> Array:
        """:meth:`__call__` with the tokens split over the ``sequence`` mesh axis (:mod:`jppo.models.context`): the
        packed rows of ``segment_ids [B, T]``, each shard's queries over the gathered keys."""
        config = self.config
        blocks = (config.attention_block_q, config.attention_block_kv)

        def attend(q, k, v):
            return sequence_attention(q, k, v, segment_ids, config.attention, blocks), None

        return self._scan(hidden, rope, attend, segment_ids != 0)[0]

    def prefill(self, hidden: Array, rope: tuple[Array, Array], rule: AttentionRule,
                layers: tuple | None = None) -> tuple[Array, tuple[Array, Array]]:
        """:meth:`__call__` that also returns every layer's keys and values, ``[L, B, K / h, T, h E]`` each (the
        layout of :func:`~jppo.models.kv_cache.cache_rows`). With ``layers`` (:meth:`unstacked`) the layers run
        one after the other on the weights decoding reads (a scan would gather batch-sharded stacks again)."""
        group = lane_group(self.config.num_kv_heads, self.config.head_dim)

        def attend(q, k, v):
            keep = tuple(cache_rows(x.transpose(0, 2, 1, 3), group) for x in (k, v))
            return self._attention(q, k, v, rule), keep

        if layers is None:
            return self._scan(hidden, rope, attend)
        kept, routed = [], []
        for weights, adapters in layers:
            hidden, layer_kept = self._block(hidden, weights, adapters, rope, attend)
            routed += [layer_kept[1][1]] if "router" in weights else []
            kept.append(layer_kept[0] if "router" in weights else layer_kept)
        record_routing(routed)
        return hidden, tuple(jnp.stack(x) for x in zip(*kept))

    def unstacked(self) -> tuple[tuple[dict, dict], ...]:
        """Each layer's ``(weights, adapters)`` sliced out of the stacks: taken once before a decoding loop, since
        XLA does not hoist the slices out of it (they cost a tenth of a small model's decode step).

        Each slice is the sampler's copy (:func:`~jppo.models.kv_cache.layer_copier`), sliced first: one layer's
        weights per layer, never a second stack."""
        copy = layer_copier(self, self.config.compute_dtype)
        return tuple(({name: copy(name, w) for name, w in weights.items()}, adapters)
                     for weights, adapters in layer_slices(self._stacked_weights(), self._stacked_adapters(),
                                                           self.config))

    def decode(
        self,
        hidden: Array,
        rope: tuple[Array, Array],
        prompt: PromptCache,
        cache: ResponseCache,
        slots: Array,
        layers: tuple[tuple[dict, dict], ...],
        prompt_rows: Array | None = None,
    ) -> tuple[Array, ResponseCache]:
        """One new token per row, ``hidden [R, 1, D]``: each layer writes the token's key and value at response
        slot ``slots[r]`` of row ``r`` and attends to the row's prompt block and response slots ``<= slots[r]``.
        ``layers`` is :meth:`unstacked`. Row ``r``'s prompt is ``prompt_rows[r]``; without ``prompt_rows`` the rows
        are prompt-major, ``R / B`` per prompt, and read the shared blocks in place (no gather). ``slots`` may be
        a scalar, every row at one slot: the blocks some row can see are then known with no reduction over rows.

        The layers are unrolled, each with its own cache arrays: a scan over stacked caches would copy a layer's
        whole cache out of the stack at every step (the cost then grows with the cache, not the arithmetic).
        """
        sizes = tuple(block.shape[2] for block in cache.keys[0])
        known = slots + 1 if isinstance(slots, int) else None  # a slot fixed at trace time: the slots every row sees
        response_visible = jnp.arange(sum(sizes))[None, :] <= jnp.reshape(slots, (-1, 1))  # [R or 1, M]
        visible = prompt.visible if prompt_rows is None else prompt.visible[prompt_rows]
        rows_of = (lambda x: x) if prompt_rows is None else (lambda x: x[prompt_rows])  # noqa: E731
        starts = [sum(sizes[:b]) for b in range(len(sizes))]
        # each row's slot within each block (one for all rows when ``slots`` is a scalar: written in place);
        # out of range (the write is dropped) outside it
        local = [jnp.where((slots >= start) & (slots < start + size), slots - start, size)
                 for start, size in zip(starts, sizes)]
        keys, values, routed = list(cache.keys), list(cache.values), []
        for index, (layer_weights, layer_adapters) in enumerate(layers):

            def attend(q, k, v, index=index):
                for stack, new in ((keys, k), (values, v)):  # new [R, 1, K, E] -> the blocks' [R, K / h, h E]
                    stack[index] = tuple(write_slot(block, where, new[:, 0].reshape(block.shape[0], block.shape[1],
                                                                                    -1).astype(block.dtype))
                                         for block, where in zip(stack[index], local))
                out = decode_attention(q[:, 0], rows_of(prompt.keys[index]), rows_of(prompt.values[index]), visible,
                                       keys[index], values[index], response_visible, known)
                return out[:, None], None

            hidden, out = self._block(hidden, layer_weights, layer_adapters, rope, attend)
            routed += [out[1][1]] if "router" in layer_weights else []
        record_routing(routed)
        return hidden, ResponseCache(keys=tuple(keys), values=tuple(values))


class Decoder(nnx.Module):
    """Token embedding, the stacked layers and the final norm: ``input_ids -> hidden [B, T, D]``."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        embedding = normal_weights(rngs, (config.vocab_size, config.hidden_size), config)
        self.embed_tokens = param(embedding, ("vocab", "embed"))
        self.layers = DecoderLayers(config, rngs=rngs)
        self.norm = param(jnp.ones((config.hidden_size,), config.weight_dtype), (None,))

    def _embed(self, input_ids: Array, positions: Array) -> tuple[Array, tuple[Array, Array]]:
        # the table gathered over "embed" (as FSDP does for any weight in use), still split by vocabulary: a
        # lookup straight from the (vocab, embed)-sharded table makes XLA replicate it whole
        embedding = constrain(self.embed_tokens[...].astype(self.config.compute_dtype), ("vocab", None))
        # clip: a padding id outside the vocabulary must not turn into NaN (jnp.take fills those with NaN)
        hidden = constrain(jnp.take(embedding, input_ids, axis=0, mode="clip"), HIDDEN)
        return hidden, rope_tables(positions, self.config)

    def _norm(self, hidden: Array) -> Array:
        return rms_norm(hidden, self.norm[...], self.config.rms_norm_eps)

    def __call__(self, input_ids: Array, positions: Array | None = None, segment_ids: Array | None = None) -> Array:
        positions, segment_ids = check_inputs(input_ids, positions, segment_ids)
        if by_product():  # trainer.deterministic: bitwise, the sampler's numbers (jppo.models.bitwise)
            return bitwise_forward(self, input_ids, positions, segment_ids)[0]
        hidden, rope = self._embed(input_ids, positions)
        if context_parallel(input_ids.shape[1]):
            return self._norm(self.layers.context_parallel(hidden, rope, segment_ids))
        return self._norm(self.layers(hidden, rope, AttentionRule.packed(segment_ids)))

    def prefill(self, input_ids: Array, positions: Array, segment_ids: Array,
                layers: tuple | None = None) -> tuple[Array, PromptCache]:
        """:meth:`__call__` on a prompt batch, plus its :class:`PromptCache` (``layers``: see
        :meth:`DecoderLayers.prefill`)."""
        positions, segment_ids = check_inputs(input_ids, positions, segment_ids)
        hidden, rope = self._embed(input_ids, positions)
        hidden, (keys, values) = self.layers.prefill(hidden, rope, AttentionRule.packed(segment_ids), layers)
        per_layer = lambda stack: tuple(constrain(layer, CACHE) for layer in stack)  # noqa: E731
        return self._norm(hidden), PromptCache(keys=per_layer(keys), values=per_layer(values),
                                               visible=segment_ids != 0)

    def decode(
        self, tokens: Array, positions: Array, prompt: PromptCache, cache: ResponseCache, slots: Array, layers: tuple,
        prompt_rows: Array | None = None,
    ) -> tuple[Array, ResponseCache]:
        """``tokens [R]`` at ``positions [R]``, written at response slots ``slots [R]`` (or one slot for all rows,
        a scalar): hidden ``[R, D]``."""
        hidden, rope = self._embed(tokens[:, None], positions[:, None])
        hidden, cache = self.layers.decode(hidden, rope, prompt, cache, slots, layers, prompt_rows)
        by_block = lambda layers: tuple(tuple(constrain(b, CACHE) for b in layer) for layer in layers)  # noqa: E731
        cache = ResponseCache(keys=by_block(cache.keys), values=by_block(cache.values))
        return self._norm(hidden[:, 0]), cache

    def init_response_cache(self, rows: int, length: int, blocks: int = RESPONSE_BLOCKS) -> ResponseCache:
        config = self.config
        group = lane_group(config.num_kv_heads, config.head_dim)  # heads side by side in a row (TPU lanes)
        shape = lambda size: (rows, config.num_kv_heads // group, size, group * config.head_dim)  # noqa: E731
        zeros = lambda: tuple(  # noqa: E731  (own buffers, one per layer and block)
            tuple(constrain(jnp.zeros(shape(size), config.compute_dtype), CACHE)
                  for size in response_blocks(length, blocks))
            for _ in range(config.num_layers)
        )
        return ResponseCache(keys=zeros(), values=zeros())


class CausalLM(nnx.Module):
    """Policy (and reference) model: the decoder and a language-model head (tied to the embedding or not)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.decoder = Decoder(config, rngs=rngs)
        shape = (config.hidden_size, config.vocab_size)
        untied = not config.tie_word_embeddings
        self.lm_head = param(normal_weights(rngs, shape, config), ("embed", "vocab")) if untied else None

    def __call__(self, input_ids: Array, positions: Array | None = None, segment_ids: Array | None = None) -> Array:
        """Logits ``[B, T, V]`` float32. Defaults: ``positions = arange(T)``, ``segment_ids = 1`` (one sequence
        per row, no padding)."""
        return self.logits(self.hidden_states(input_ids, positions, segment_ids))

    def hidden_states(
        self, input_ids: Array, positions: Array | None = None, segment_ids: Array | None = None
    ) -> Array:
        """Final-norm hidden states ``[B, T, D]`` (compute dtype)."""
        return self.decoder(input_ids, positions, segment_ids)

    def prefill(self, input_ids: Array, positions: Array, segment_ids: Array,
                layers: tuple | None = None) -> tuple[Array, PromptCache]:
        """Hidden states of a prompt batch ``[B, P]`` and its :class:`PromptCache` (segment 0 is padding); with
        ``layers`` (:meth:`decoding_layers`) computed on the sampler's copies of the weights."""
        return self.decoder.prefill(input_ids, positions, segment_ids, layers)

    def decode(
        self, tokens: Array, positions: Array, prompt: PromptCache, cache: ResponseCache, slots: Array, layers: tuple,
        prompt_rows: Array | None = None,
    ) -> tuple[Array, ResponseCache]:
        """One token per row: ``tokens [R]`` at ``positions [R]``, its keys and values written at response slot
        ``slots[r]`` of row ``r``, attending to its prompt (``prompt_rows[r]`` of ``prompt``; by default rows are
        prompt-major, ``R / B`` per prompt) and its response slots ``<= slots[r]``. ``layers`` is
        :meth:`decoding_layers`, taken once before the decoding loop. Returns hidden ``[R, D]`` and the cache."""
        return self.decoder.decode(tokens, positions, prompt, cache, slots, layers, prompt_rows)

    def for_decoding(self) -> "CausalLM":
        """This model with the sampler's copies (:func:`~jppo.models.sharding.decoding_copy`) of its embedding
        table and untied LM head, which every decoding step reads: cast to the compute dtype and laid out for
        decoding, made once before the loop. The layers' copies are :meth:`decoding_layers`'."""
        return with_decoding_copies(self, ("embed_tokens", "lm_head"))

    def decoding_layers(self) -> tuple:
        """Each layer's weights as arrays of their own, for :meth:`decode` (see ``DecoderLayers.unstacked``)."""
        return self.decoder.layers.unstacked()

    def init_response_cache(self, rows: int, length: int, blocks: int = RESPONSE_BLOCKS) -> ResponseCache:
        """An empty :class:`ResponseCache` of ``rows`` rows and ``length`` slots, in up to ``blocks`` blocks
        (:func:`~jppo.models.layers.response_blocks`)."""
        return self.decoder.init_response_cache(rows, length, blocks)

    def logits(self, hidden: Array) -> Array:
        """``hidden [..., D] -> logits [..., V]`` in float32."""
        dtype = self.config.compute_dtype
        table = self.decoder.embed_tokens if self.lm_head is None else self.lm_head
        # its gradient split like the table as each chunk of log-probs makes it (constrain_gradient), not whole
        kernel = constrain_gradient(table[...], logical_names(table)).astype(dtype)
        kernel = kernel.T if self.lm_head is None else kernel
        logits = dense(hidden, kernel, preferred_element_type=wide(dtype))
        return constrain(logits, ("batch", "length", "vocab")) if logits.ndim == 3 else logits
