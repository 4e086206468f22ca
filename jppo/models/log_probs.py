"""Per-token log-probabilities (and entropies) without a ``[B, T, V]`` float32 array in forward or backward.

With ``z = logits / temperature`` of the hidden state before token ``t``:

    log_prob_t = z[target_t] - logsumexp(z),     entropy_t = logsumexp(z) - sum_v softmax(z)_v z_v.

The entropy is :func:`~jppo.losses.entropy.entropy_from_logits`, the one implementation the losses use: it is
finite in value and gradient when some ``z_v = -inf`` (a masked vocabulary entry, where the naive
``softmax(z)_v z_v`` is ``0 * -inf = NaN``). Such entries also leave ``logsumexp`` finite; only a target at
``-inf`` gets ``log_prob = -inf``.

The vocabulary projection and the logsumexp run over sequence chunks of ``chunk_size`` positions (all rows at
once, so sharded rows stay parallel), one chunk at a time under ``jax.checkpoint``: the backward pass recomputes
a chunk's logits instead of keeping them, so the peak holds ``[B, chunk_size, V]``, not ``[B, T, V]``. When one
chunk covers the whole row (``chunk_size >= T``) there is nothing to trade: the head's backward pass directly
follows its forward pass, so keeping the logits costs the same peak as recomputing them, and the chunk runs
without the checkpoint (one vocabulary projection fewer per step).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jppo.losses.entropy import entropy_from_logits
from jppo.models.attention import by_product
from jppo.models.bitwise import over_tokens
from jppo.models.context import sequence_shards_of
from jppo.models.decoder import CausalLM
from jppo.models.sharding import constrain

Array = jax.Array

DEFAULT_CHUNK_SIZE = 128


def token_log_probs(
    model: CausalLM,
    input_ids: Array,
    positions: Array,
    segment_ids: Array,
    targets: Array,
    *,
    temperature: float | Array = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    with_entropy: bool = False,
) -> tuple[Array, Array | None]:
    """``(log_probs [B, T], entropy [B, T] or None)``, float32: ``log softmax(logits / temperature)`` of
    ``targets [B, T]`` (usually the next token) at every position, and the entropy of that distribution.

    Values at padding positions are finite but meaningless (targets are clipped into the vocabulary); the
    caller masks them.
    """
    if targets.shape != input_ids.shape:
        raise ValueError(f"targets shape {tuple(targets.shape)} does not match input_ids {tuple(input_ids.shape)}")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    if isinstance(temperature, (int, float)) and temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    hidden = model.hidden_states(input_ids, positions, segment_ids)
    targets = jnp.clip(targets, 0, model.config.vocab_size - 1)
    if by_product():  # trainer.deterministic: bitwise, the sampler's numbers (jppo.models.bitwise)
        return bitwise_log_probs(model, hidden, targets, temperature, with_entropy)
    shards = sequence_shards_of(hidden.shape[1])
    if shards > 1:
        return _split_token_log_probs(model, hidden, targets, shards, temperature, chunk_size, with_entropy)
    batch, length, width = hidden.shape
    chunk = min(chunk_size, length)
    num_chunks = -(-length // chunk)
    pad = num_chunks * chunk - length
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
    # [num_chunks, B, chunk, ...]: each step of the map sees every row
    hidden = hidden.reshape(batch, num_chunks, chunk, width).swapaxes(0, 1)
    targets = targets.reshape(batch, num_chunks, chunk).swapaxes(0, 1)

    one_chunk = _chunk_fn(model, temperature, with_entropy)
    if num_chunks == 1:
        log_probs, entropy = jax.tree.map(lambda x: x[None], one_chunk((hidden[0], targets[0])))
    else:
        log_probs, entropy = jax.lax.map(jax.checkpoint(one_chunk), (hidden, targets))
    unchunk = lambda x: x.swapaxes(0, 1).reshape(batch, num_chunks * chunk)[:, :length]  # noqa: E731
    return unchunk(log_probs), (unchunk(entropy) if with_entropy else None)


def _chunk_fn(model: CausalLM, temperature: float | Array, with_entropy: bool):
    def one_chunk(chunk_inputs: tuple[Array, Array]) -> tuple[Array, Array]:
        chunk_hidden, chunk_targets = chunk_inputs
        scaled = model.logits(chunk_hidden) / temperature
        normalizer = jax.nn.logsumexp(scaled, axis=-1)
        chosen = select_target(scaled, chunk_targets)
        if not with_entropy:
            return chosen - normalizer, jnp.zeros_like(normalizer)
        # With several chunks, the checkpoint recomputes these [B, chunk, V] temporaries in the backward pass.
        return chosen - normalizer, entropy_from_logits(scaled)

    return one_chunk


def _split_token_log_probs(
    model: CausalLM, hidden: Array, targets: Array, shards: int, temperature, chunk_size: int, with_entropy: bool
) -> tuple[Array, Array | None]:
    """:func:`token_log_probs` of ``hidden [B, T, D]`` whose tokens are split over the ``sequence`` axis in
    ``shards`` blocks of ``T / shards`` (:mod:`jppo.models.context`): every shard runs the chunks of its own block,
    ``[B, shards, chunk, V]`` logits at a time with the ``shards`` axis split, so no shard computes another's
    logits and the hidden states never move. The targets (the next tokens) were taken from the whole row."""
    batch, length, width = hidden.shape
    block = length // shards
    chunk = min(chunk_size, block)
    num_chunks = -(-block // chunk)
    pad = num_chunks * chunk - block

    def by_chunk(x: Array) -> Array:  # [B, T, ...] -> [num_chunks, B, shards, chunk, ...], shards split
        x = constrain(x.reshape(batch, shards, block, *x.shape[2:]), ("batch", "length") + (None,) * (x.ndim - 1))
        x = jnp.pad(x, ((0, 0), (0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 3))
        return jnp.moveaxis(x.reshape(batch, shards, num_chunks, chunk, *x.shape[3:]), 2, 0)

    one_chunk = _chunk_fn(model, temperature, with_entropy)
    inputs = (by_chunk(hidden), by_chunk(targets))
    if num_chunks == 1:
        log_probs, entropy = jax.tree.map(lambda x: x[None], one_chunk(jax.tree.map(lambda x: x[0], inputs)))
    else:
        log_probs, entropy = jax.lax.map(jax.checkpoint(one_chunk), inputs)

    def unchunk(x: Array) -> Array:  # [num_chunks, B, shards, chunk] -> [B, T]
        return jnp.moveaxis(x, 0, 2).reshape(batch, shards, -1)[:, :, :block].reshape(batch, length)

    return unchunk(log_probs), (unchunk(entropy) if with_entropy else None)


def select_target(values: Array, targets: Array) -> Array:
    """``values[..., targets]`` of ``values [..., V]`` and integer ``targets [...]`` in ``[0, V)``, as a sum over
    ``V`` of the values where the index equals the target and zeros elsewhere: exactly the target's value.

    The same numbers as ``take_along_axis``; unlike a gather, its gradient is an elementwise select that XLA fuses
    with the softmax's gradient, instead of a scatter into a zeroed ``[..., V]`` array.
    """
    index = jax.lax.broadcasted_iota(targets.dtype, values.shape, values.ndim - 1)
    return jnp.sum(jnp.where(index == targets[..., None], values, jnp.zeros((), values.dtype)), axis=-1)


def bitwise_log_probs(model: CausalLM, hidden: Array, targets: Array, temperature, with_entropy: bool = False
                      ) -> tuple[Array, Array | None]:
    """:func:`token_log_probs` of final hidden states ``hidden [B, T, D]`` over :data:`~jppo.models.bitwise.CHUNK`
    tokens at a time (:func:`~jppo.models.bitwise.over_tokens`): each token's log-prob has the same bits as the
    sampler's in ``trainer.deterministic: bitwise``, which calls this on its rows' new tokens. The entropy, when
    asked for, is a pass of its own (the log-prob's program stays the sampler's)."""
    def log_prob(h: Array, target: Array) -> Array:
        scaled = model.logits(h) / temperature
        return select_target(scaled, target) - jax.nn.logsumexp(scaled, axis=-1)

    log_probs = over_tokens(log_prob, hidden, targets)
    if not with_entropy:
        return log_probs, None
    return log_probs, over_tokens(lambda h: entropy_from_logits(model.logits(h) / temperature), hidden)
