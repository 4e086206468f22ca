"""The generation loop: one prefill of the prompt batch, then token-by-token decoding from a KV cache.

For a batch of ``B`` prompts padded to width ``P`` and ``n`` samples per prompt (``R = B n`` rows, prompt-major):

1. positions are ``cumsum(mask) - 1`` and segment ids are ``mask`` (padding is segment 0, so no real token ever
   attends to it);
2. the whole prompt batch is prefilled in one call into a :class:`~jppo.models.PromptCache` holding each prompt's
   keys and values once, however many samples it gets (its ``n`` samples read one shared block), and the logits
   of each prompt's last real token give the first new token of each of its samples;
3. step ``t >= 1`` feeds token ``t - 1`` of every row at response slot ``t - 1`` and position ``len(prompt) + t -
   1`` of a :class:`~jppo.models.ResponseCache` (``R x max_new_tokens`` slots; with continuous batching
   ``S = max_num_seqs`` rows decode at once and a finished row's slot takes the next waiting row, so the cache has
   ``S x max_new_tokens`` slots) and samples token ``t``, inside ``lax.while_loop``, which stops once every row
   has finished. On a mesh each device runs the loop on its own rows
   (:func:`~jppo.parallel.mesh.on_each_device`) and stops when they have finished: its stop test reduces nothing
   over the mesh.

A row finishes at its first token in ``eos_token_ids`` (kept, and counted in the mask) or after
``max_new_tokens``; later slots hold ``pad_token_id`` with mask 0 and log-prob 0. A row whose prompt mask is all
zero (e.g. a filler row that makes the batch divisible by the mesh) gets an empty response.

Row ``r`` draws token ``t`` with ``fold_in(fold_in(key, r), t)`` (:func:`row_keys`): a row's tokens depend on the
key, its index and its own logits only, whether or not the loop stops early. Nothing leaves the device inside
the loop, so the program runs unchanged with rows sharded over a mesh.

On a mesh the program is traced in the sampler's layout (:func:`~jppo.parallel.mesh.decoding_layout`): the prompts
and rows are split over every batch axis (``data``, ``fsdp`` and ``sequence``), each device prefills and decodes its
own rows from its own caches in a loop of its own, so a decoded token communicates nothing on a mesh without
``tensor`` (with ``expert`` on a mixture, the group's devices exchange tokens and decode in step); the rows leave
in the layout of every other batch (over ``data`` and ``fsdp``), gathered over ``sequence`` once per rollout.

Compilation depends on the shapes ``(B, P)`` and on :class:`SamplingParams`, never on the prompt contents: pad
prompts to a few bucketed widths (:func:`jppo.rollout.sampler.pad_prompts`) and one compilation serves every
batch in a bucket.

Deliberate differences from verl's vLLM/SGLang rollout: log-probs are always those of the unfiltered tempered
distribution (vLLM can return them after top-k/top-p), and ``temperature <= 0`` is accepted only with
``greedy=True`` instead of silently meaning greedy.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from jppo.models.attention import normalized_by_product
from jppo.models.kv_cache import cache_block_count
from jppo.models.moe import collect_routing
from jppo.models.sharding import constrain
from jppo.parallel.mesh import decoding_layout, decoding_loop_axes, on_each_device
from jppo.rollout.bitwise import sample_rows
from jppo.rollout.continuous import continuous_rollout
from jppo.rollout.params import SamplingParams
from jppo.rollout.processors import draw, row_keys
from jppo.rollout.routing import compact, empty_record, prompt_and_response, write_step

Array = jax.Array


@struct.dataclass
class RolloutBatch:
    """What a rollout produced; ``R = B * n`` rows, prompt-major (``[p0s0, p0s1, ..., p1s0, ...]``).

    Attributes:
        prompt_ids: ``[R, P]`` the prompts as given (left-padded), each repeated ``n`` times.
        prompt_mask: ``[R, P]`` bool.
        response_ids: ``[R, max_new_tokens]`` int32, ``pad_token_id`` after the end.
        response_mask: ``[R, max_new_tokens]`` bool, generated tokens up to and including the first EOS.
        log_probs: ``[R, max_new_tokens]`` float32, ``log softmax(logits / T)`` of each sampled token under the
            unfiltered tempered distribution; 0 where the mask is 0.
        decode_slots: int32 ``[loops]``, row-steps each decoding loop computed (its steps x the rows it decoded at
            once): one loop per device of the mesh axes the rows are split over
            (:func:`~jppo.parallel.mesh.decoding_loop_axes`), else one. Every generated token but a row's first
            took one, so ``sum(response_mask) - rows with a token`` over their sum is the fraction of decoding
            work that was useful. Summed by whoever reads them, so the program reduces nothing over the mesh.
        routed_experts: with ``params.record_routing`` (a model with experts), ``[R, P + max_new_tokens, Ls, k]``:
            each token's experts at each layer with experts (:mod:`jppo.rollout.routing`); else None.
    """

    prompt_ids: Array
    prompt_mask: Array
    response_ids: Array
    response_mask: Array
    log_probs: Array
    decode_slots: Array
    routed_experts: Array | None = None


@struct.dataclass
class _DecodeState:
    step: Array  # index of the next token to sample
    last_tokens: Array  # [R] the token sampled at step - 1
    done: Array  # [R] finished before this step
    cache: Any
    response_ids: Array
    response_mask: Array
    log_probs: Array
    routed: Any = None  # routing replay: the response's record [R, max_new, Ls, k] (jppo.rollout.routing)


def _check_inputs(vocab_size: int, prompt_ids: Any, prompt_mask: Any, params: SamplingParams) -> None:
    """Shape and id checks: they need only static information, so they run before anything is compiled."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
    ids_shape, mask_shape = tuple(np.shape(prompt_ids)), tuple(np.shape(prompt_mask))
    if len(ids_shape) != 2 or ids_shape != mask_shape:
        raise ValueError(
            f"prompt_ids and prompt_mask must both be [batch, prompt_len]; got prompt_ids {ids_shape} and "
            f"prompt_mask {mask_shape}"
        )
    if ids_shape[0] == 0 or ids_shape[1] == 0:
        raise ValueError(f"prompt_ids of shape {ids_shape} is empty: need at least one row and one column")
    for name, ids in (("eos_token_ids", params.eos_token_ids), ("pad_token_id", (params.pad_token_id,))):
        if any(t >= vocab_size for t in ids):
            raise ValueError(f"SamplingParams.{name}={ids} has ids outside the vocabulary of size {vocab_size}")


def _record(state: _DecodeState, logits: Array, keys: Array, params: SamplingParams) -> _DecodeState:
    """Samples token ``state.step`` from ``logits`` and writes it (or padding, for finished rows) to the buffers."""
    tokens, log_probs = draw(keys, jnp.broadcast_to(state.step, keys.shape), logits, params)
    live = ~state.done
    tokens = jnp.where(live, tokens, params.pad_token_id)
    is_eos = jnp.isin(tokens, jnp.asarray(params.eos_token_ids, dtype=jnp.int32)) & live
    column = state.step
    return state.replace(
        step=state.step + 1,
        last_tokens=tokens,
        done=state.done | is_eos,
        response_ids=state.response_ids.at[:, column].set(tokens),
        response_mask=state.response_mask.at[:, column].set(live),
        log_probs=state.log_probs.at[:, column].set(jnp.where(live, log_probs, 0.0)),
    )


def prefill(model: Any, prompt_ids: Array, prompt_mask: Array, layers: Any = None) -> tuple[Any, Array, Array]:
    """Encodes the prompt batch once: its cache, each prompt's real token count, and the logits of each prompt's
    last real token (which give the first new token); ``layers``: the model's ``decoding_layers()``, to run on."""
    counts = jnp.cumsum(prompt_mask, axis=1, dtype=jnp.int32)
    positions = jnp.where(prompt_mask, counts - 1, 0)
    hidden, prompt = model.prefill(prompt_ids, positions, prompt_mask.astype(jnp.int32), layers)
    # The first new token follows each row's last real prompt token (the last column for left-padded prompts).
    prompt_len = prompt_ids.shape[1]
    last_real = prompt_len - 1 - jnp.argmax(prompt_mask[:, ::-1], axis=1)
    first_logits = model.logits(jnp.take_along_axis(hidden, last_real[:, None, None], axis=1)[:, 0])
    return prompt, counts[:, -1], first_logits


def decode_rows(rows: int, max_num_seqs: int) -> int:
    """How many of a batch's ``rows`` are decoded at once, and so the rows of its response cache: the
    ``max_num_seqs`` slots of continuous batching when that is fewer, else every row (``0`` means every row)."""
    return max_num_seqs if 0 < max_num_seqs < rows else rows


def response_cache(model: Any, rows: int, params: SamplingParams) -> Any:
    """The empty response cache the decoding loop fills for a batch of ``rows`` rows: one row per row decoded at
    once (:func:`decode_rows`), ``params.max_new_tokens`` slots each, in :func:`cache_block_count` blocks. With
    the prompt cache of :func:`prefill` it is all the sampler keeps of keys and values."""
    return model.init_response_cache(decode_rows(rows, params.max_num_seqs), params.max_new_tokens,
                                     cache_block_count(params.cache_blocks))


def rollout(model: Any, prompt_ids: Array, prompt_mask: Array, key: Array, params: SamplingParams) -> RolloutBatch:
    """Samples responses; a traceable function of arrays (call it under ``jax.jit``, or use :func:`generate`),
    in the sampler's layout (module docstring); its rows come back in the layout of any other batch.

    Args:
        model: a ``CausalLM`` (``for_decoding``/``prefill``/``decode``/``decoding_layers``/``init_response_cache``/
            ``logits``).
        prompt_ids: ``[B, P]`` integer, padded (left-padded by :func:`~jppo.rollout.sampler.pad_prompts`; any layout
            works, since each row continues after its last real token).
        prompt_mask: ``[B, P]`` bool (or 0/1), 1 on real prompt tokens.
        key: PRNG key.
        params: static :class:`SamplingParams`.
    """
    _check_inputs(model.config.vocab_size, prompt_ids, prompt_mask, params)
    with decoding_layout():
        by_row = lambda x: constrain(x, ("batch", None))  # noqa: E731
        if params.bitwise:  # the decoder's bitwise path (jppo.rollout.bitwise), normalized by products
            with normalized_by_product():
                out = _bitwise(model, by_row(prompt_ids), by_row(prompt_mask), key, params)
        else:
            out = _sample(model, by_row(prompt_ids), by_row(prompt_mask), key, params)
    return jax.tree.map(lambda x: constrain(x, ("batch",) + (None,) * (x.ndim - 1)) if x.ndim >= 2 else x, out)


def _bitwise(model: Any, prompt_ids: Array, prompt_mask: Array, key: Array, params: SamplingParams) -> RolloutBatch:
    """Each device samples its own prompts by :func:`jppo.rollout.bitwise.sample_rows`, its rows drawing with their
    global indices: a row's tokens and log-probs are the same bits on any device count, and its log-probs the
    trainer's."""
    batch, n = prompt_ids.shape[0], params.n
    axes = decoding_loop_axes(batch, batch, bool(getattr(model.config, "num_experts", 0)))

    def per_device(ids: Array, mask: Array) -> RolloutBatch:
        first = (jax.lax.axis_index(axes) if axes else 0) * ids.shape[0]  # this device's first global prompt
        ids, mask = ids.astype(jnp.int32), mask.astype(bool)
        out = sample_rows(model, ids, mask, key, params, first * n)
        return RolloutBatch(prompt_ids=jnp.repeat(ids, n, axis=0), prompt_mask=jnp.repeat(mask, n, axis=0),
                            response_ids=out["response_ids"], response_mask=out["response_mask"],
                            log_probs=out["log_probs"], decode_slots=((out["steps"] - 1) * ids.shape[0] * n)[None])

    return on_each_device(per_device, axes, (prompt_ids, prompt_mask), ())


def _sample(
    model: Any, prompt_ids: Array, prompt_mask: Array, key: Array, params: SamplingParams, first_row: Any = 0,
) -> RolloutBatch:
    """:func:`rollout`'s program, traced in the sampler's layout; its rows are the global rows ``first_row`` on
    (their keys: :func:`~jppo.rollout.processors.row_keys`)."""
    batch = prompt_ids.shape[0]
    n, max_new = params.n, params.max_new_tokens
    prompt_ids = prompt_ids.astype(jnp.int32)
    prompt_mask = prompt_mask.astype(bool)
    model = model.for_decoding()
    layers = model.decoding_layers()
    with collect_routing() as routed:
        prompt, prompt_counts, first_logits = prefill(model, prompt_ids, prompt_mask, layers)
    recorded = bool(routed) and params.record_routing  # routing replay: the prompt's experts [B, P, Ls, k]
    prompt_routing = compact(routed[0], model.config.num_experts) if recorded else None
    if decode_rows(batch * n, params.max_num_seqs) < batch * n:
        out = continuous_rollout(model, prompt, prompt_counts, first_logits, key, params, layers,
                                 loop_axes(model, batch * n, params))
        routing = prompt_and_response(prompt_routing, out.routed_experts, n) if recorded else None
        return RolloutBatch(prompt_ids=jnp.repeat(prompt_ids, n, axis=0),
                            prompt_mask=jnp.repeat(prompt_mask, n, axis=0), response_ids=out.response_ids,
                            response_mask=out.response_mask, log_probs=out.log_probs,
                            decode_slots=out.decode_slots, routed_experts=routing)

    rows = batch * n
    axes = loop_axes(model, rows, params)
    keys = row_keys(key, first_row + jnp.arange(rows))
    prompt_tokens = jnp.repeat(prompt_counts, n)
    state = _DecodeState(
        step=jnp.zeros((), jnp.int32),
        last_tokens=jnp.zeros((rows,), jnp.int32),
        done=prompt_tokens == 0,
        cache=response_cache(model, rows, params),
        response_ids=jnp.full((rows, max_new), params.pad_token_id, jnp.int32),
        response_mask=jnp.zeros((rows, max_new), bool),
        log_probs=jnp.zeros((rows, max_new), jnp.float32),
        routed=empty_record(rows, max_new, model.config) if recorded else None,
    )
    state = _record(state, jnp.repeat(first_logits, n, axis=0), keys, params)

    def loop(state: _DecodeState, prompt: Any, prompt_tokens: Array, keys: Array, layers: Any) -> _DecodeState:
        def unfinished(state: _DecodeState) -> Array:
            return (state.step < max_new) & ~jnp.all(state.done)

        def decode_step(state: _DecodeState) -> _DecodeState:
            fed = state.step - 1  # one slot for every row: a scalar, so no predicate is reduced over the rows
            with collect_routing() as routed:
                hidden, cache = model.decode(state.last_tokens, prompt_tokens + fed, prompt, state.cache, fed,
                                             layers)
            if recorded:  # the fed tokens' experts, where the fed token is a response token
                mine = state.last_tokens.shape[0]  # the rows of this loop (one device's, or all)
                state = state.replace(routed=write_step(state.routed, jnp.arange(mine), jnp.broadcast_to(fed, (mine,)),
                                                        routed[0], state.response_mask[:, fed]))
            return _record(state.replace(cache=cache), model.logits(hidden), keys, params)

        state = jax.lax.while_loop(unfinished, decode_step, state)
        return state.replace(step=state.step[None])  # each device's own count

    state = on_each_device(loop, axes, (state, prompt, prompt_tokens, keys), (layers,))
    return RolloutBatch(
        prompt_ids=jnp.repeat(prompt_ids, n, axis=0),
        prompt_mask=jnp.repeat(prompt_mask, n, axis=0),
        response_ids=state.response_ids,
        response_mask=state.response_mask,
        log_probs=state.log_probs,
        decode_slots=(state.step - 1) * (rows // state.step.shape[0]),
        routed_experts=prompt_and_response(prompt_routing, state.routed, n) if recorded else None,
    )


def loop_axes(model: Any, rows: int, params: SamplingParams) -> tuple[str, ...]:
    """The mesh axes each device decodes its own of ``rows`` over (:func:`~jppo.parallel.mesh.decoding_loop_axes`)."""
    experts = bool(getattr(model.config, "num_experts", 0))
    return decoding_loop_axes(rows, decode_rows(rows, params.max_num_seqs), experts)


@functools.lru_cache(maxsize=32)
def make_generate_fn(graphdef: nnx.GraphDef, params: SamplingParams) -> Callable[..., RolloutBatch]:
    """A jitted ``fn(state, prompt_ids, prompt_mask, key) -> RolloutBatch`` for ``graphdef, state = nnx.split(model)``.

    Calls with the same ``(graphdef, params)`` return the same function, so a training loop that splits its policy
    every step still compiles once per prompt shape. Shape errors are raised at trace time, before compilation.
    """
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")

    @jax.jit
    def generate_fn(state: nnx.State, prompt_ids: Array, prompt_mask: Array, key: Array) -> RolloutBatch:
        return rollout(nnx.merge(graphdef, state), prompt_ids, prompt_mask, key, params)

    return generate_fn


def generate(model: Any, prompt_ids: Array, prompt_mask: Array, key: Array, params: SamplingParams) -> RolloutBatch:
    """Samples ``params.n`` responses per prompt with ``model``; see :class:`RolloutBatch` for the layout.

    Compiles once per ``(model structure, params, prompt shape)``; inputs are checked while tracing, before that.
    """
    graphdef, state = nnx.split(model)
    return make_generate_fn(graphdef, params)(state, prompt_ids, prompt_mask, key)
