"""Turning next-token logits into a sampled token and its log-probability.

For one row with logits ``z`` (shape ``[V]``) and temperature ``T``, the *tempered distribution* is
``pi = softmax(z / T)``. Sampling draws from ``pi`` after two optional filters, applied in this order (the order
of Hugging Face's warpers and vLLM's sampler):

- top-k keeps the ``k`` tokens with the largest ``z`` (exactly ``k``: ties are broken by ``lax.top_k``);
- top-p keeps the nucleus of what is left: sorted by probability ``q_(1) >= q_(2) >= ...`` (``q`` = the tempered
  distribution renormalized over the top-k survivors), token ``(j)`` stays iff ``sum_{i<j} q_(i) < p``. That is
  the smallest prefix whose probability reaches ``p``, and it always holds the most likely token. Ties in the
  order are broken by the lower vocabulary index, as ``lax.top_k`` breaks them. After top-k the ``k`` survivors
  are already sorted; without it the nucleus is found without sorting the vocabulary (:func:`nucleus_mask`).

The sampled token is drawn from the filtered distribution renormalized over the survivors. Its log-probability
is reported under the *unfiltered* tempered distribution, ``log pi(token) = z_token / T - logsumexp(z / T)``,
because that is what the trainer recomputes from the model (it never sees the filters).

Greedy decoding is ``argmax z``. Its log-probability uses ``T`` when ``T > 0`` and ``T = 1`` otherwise, so that
``temperature=0`` (a common way of asking for greedy) still reports the model's own log-probabilities.

A decoding batch draws row by row (:func:`draw`): row ``r``'s token ``t`` with ``fold_in(fold_in(key, r), t)``
(:func:`row_keys`), so a row's sample does not depend on the other rows or on where it is decoded.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jppo.rollout.params import SamplingParams

Array = jax.Array


def log_prob_temperature(temperature: float) -> float:
    """The temperature under which log-probabilities are reported: ``temperature`` if positive, else 1."""
    return temperature if temperature > 0 else 1.0


def tempered_log_prob(logits: Array, tokens: Array, temperature: float) -> Array:
    """``log softmax(logits / T)[tokens]`` per row, in float32.

    Args:
        logits: ``[..., V]``.
        tokens: ``[...]`` integer token ids.
        temperature: ``T > 0``.
    """
    scaled = logits.astype(jnp.float32) / temperature
    chosen = jnp.take_along_axis(scaled, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return chosen - jax.nn.logsumexp(scaled, axis=-1)


def nucleus_keep(sorted_logits: Array, top_p: float) -> Array:
    """Which entries of descending-sorted logits form the top-p nucleus (``[..., K]`` bool).

    Entry ``j`` stays iff the probability of the entries before it, under ``softmax(sorted_logits)``, is below
    ``top_p``; entry 0 always stays. Entries equal to ``-inf`` get probability 0 and stay out unless first.
    """
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = mass_before < top_p
    # Rounding in the cumulative sum must never empty the nucleus.
    return keep.at[..., 0].set(True)


def _total_order_keys(values: Array) -> Array:
    """int32 keys that sort like float32 ``values`` in IEEE total order (``-0.0 < +0.0``), the order of ``lax.top_k``.

    The bits of a non-negative float count upwards with its value; those of a negative one count the other way, so
    their 31 low bits are flipped. Equal keys are equal bit patterns: the ties of ``lax.top_k``.
    """
    bits = jax.lax.bitcast_convert_type(values, jnp.int32)
    return bits ^ (jnp.right_shift(bits, 31) & 0x7FFFFFFF)


def nucleus_mask(logits: Array, top_p: float) -> Array:
    """The top-p nucleus of unsorted logits (``[..., V]`` bool, vocabulary order) without sorting the vocabulary.

    The set is :func:`nucleus_keep`'s on the sorted logits. Order the tokens as ``lax.top_k`` does (logit
    descending, ties by lower index); with ``q = softmax(logits)``, token ``x`` stays iff the mass before it,
    ``M(x) = F(key_x) + r_x q_x``, is below ``p``, where ``F(k) = sum_{key_y > k} q_y`` is the mass of larger keys
    (``key``: :func:`_total_order_keys`) and ``r_x`` counts the earlier tokens of ``x``'s tie.

    ``F`` is non-increasing, so the smallest key ``T`` with ``F(T) < p`` is found by bisection over the int32
    keys: 32 steps of one masked sum each (``O(V)``), exact because the keys are integers. ``F(T - 1) >= p > F(T)``
    means tokens of key ``T`` carry mass, so ``T`` is a logit in the row; every larger key has ``M < F(T) < p``
    and stays, every smaller key has ``M >= F(T - 1) >= p`` and goes, and the tie at ``T`` keeps its first tokens
    while ``F(T) + r q_T < p``. The most likely token (lowest index among ties) always stays: its mass before is
    exactly 0. Entries equal to ``-inf`` have ``q = 0`` and stay out unless every other entry is in and the mass
    of those still rounds below ``p``, as in the sorted computation.

    In float32 the search stays exact for the computed ``F``: each masked sum adds the same terms in a fixed tree
    with some of them zeroed, and rounding is monotone, so the computed ``F`` is non-increasing too. It differs
    from the sorted cumulative sum only in rounding (other summation order), so the two sets can differ only at a
    token whose mass before lies within rounding of ``p`` (up to ~1e-6 absolute for a 32k vocabulary; the sorted
    sum, added one token at a time, is the less accurate of the two).
    """
    probs = jax.nn.softmax(logits, axis=-1)
    keys = _total_order_keys(logits)

    def mass_above(threshold: Array) -> Array:
        return jnp.sum(jnp.where(keys > threshold, probs, 0), axis=-1, keepdims=True)

    def halve(_, bounds: tuple[Array, Array]) -> tuple[Array, Array]:
        # Invariant: F(high) < p, and low < T (F(low) >= p, or low is below every key).
        low, high = bounds
        middle = jnp.right_shift(low, 1) + jnp.right_shift(high, 1) + (low & high & 1)  # floor((low + high) / 2)
        below = mass_above(middle) < top_p
        open_ = low < high - 1  # high - low could overflow int32
        return jnp.where(open_ & ~below, middle, low), jnp.where(open_ & below, middle, high)

    # keys span less than 2^32, and each step halves the open interval (low, high]
    bounds = (jnp.min(keys, axis=-1, keepdims=True) - 1, jnp.max(keys, axis=-1, keepdims=True))
    _, threshold = jax.lax.fori_loop(0, 32, halve, bounds)
    tied = keys == threshold
    earlier_ties = jnp.cumsum(tied, axis=-1, dtype=jnp.int32) - tied
    tie_prob = jnp.max(jnp.where(tied, probs, 0), axis=-1, keepdims=True)
    return (keys > threshold) | (tied & (mass_above(threshold) + earlier_ties * tie_prob < top_p))


def sample_tokens(
    key: Array,
    logits: Array,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    greedy: bool = False,
) -> tuple[Array, Array]:
    """Draws one token per row and returns ``(tokens [...] int32, log_probs [...] float32)``.

    ``log_probs`` are under the unfiltered tempered distribution (see the module docstring). The filters are
    static (``top_k`` fixes a shape), so each setting compiles once; ``top_k=0`` and ``top_p=1`` switch them off.

    Args:
        key: a PRNG key; rows draw independently from it.
        logits: ``[..., V]`` next-token logits.
        temperature: ``T``; must be positive unless ``greedy``.
        top_k: keep the ``k`` most likely tokens (``0``: all). ``k >= V`` keeps all.
        top_p: nucleus mass in ``(0, 1]`` (``1``: all).
        greedy: take ``argmax logits`` and ignore the key and the filters.
    """
    logits = logits.astype(jnp.float32)
    vocab_size = logits.shape[-1]
    if greedy:
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return tokens, tempered_log_prob(logits, tokens, log_prob_temperature(temperature))

    scaled = logits / temperature
    k = min(top_k, vocab_size) if top_k > 0 else vocab_size
    if k == vocab_size and top_p >= 1.0:
        tokens = jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)
    elif k == vocab_size:
        # top-p alone: 32 masked sums over the vocabulary find the nucleus; sorting it cost ~7x more on CPU.
        nucleus = jnp.where(nucleus_mask(scaled, top_p), scaled, -jnp.inf)
        tokens = jax.random.categorical(key, nucleus, axis=-1).astype(jnp.int32)
    else:
        # Sample among the k best in sorted order, then map the choice back to a vocabulary id.
        best, best_ids = jax.lax.top_k(scaled, k)
        if top_p < 1.0:
            best = jnp.where(nucleus_keep(best, top_p), best, -jnp.inf)
        choice = jax.random.categorical(key, best, axis=-1)
        tokens = jnp.take_along_axis(best_ids, choice[..., None], axis=-1)[..., 0].astype(jnp.int32)
    return tokens, tempered_log_prob(logits, tokens, temperature)


def row_keys(key: Array, rows: Array) -> Array:
    """The key of each row: ``fold_in(key, row)`` for global row indices ``rows``. Token ``t`` of a row is drawn
    with ``fold_in(row key, t)``, so a row's sample depends only on its key, its index and its own logits: not on
    the other rows, the batch size, the loop stopping early or the order rows are decoded in."""
    return jax.vmap(lambda row: jax.random.fold_in(key, row))(rows)


def one_pass_draw(keys: Array, logits: Array, temperature: float) -> tuple[Array, Array]:
    """``(tokens, log_probs)`` of unfiltered sampling at temperature ``T`` from ``logits [R, V]``, row ``r`` drawing
    with ``keys[r]``, in ONE reduction over the vocabulary.

    The draw is :func:`sample_tokens`'s (``jax.random.categorical``: the Gumbel-max trick, ``argmax_x z_x / T +
    g_x`` with ``g = gumbel(key, [V])``, ties to the lower index): the same tokens. The log-probability
    ``z_tok / T - logsumexp(z / T)`` comes from the same reduction: each element carries ``(m, s, c, best, index,
    z_best)`` and two partial results combine as ``m = max(m1, m2)``, ``s = s1 e^(m1 - m) + s2 e^(m2 - m)`` (the
    running log-sum-exp, ``logsumexp = m + log(s + c)``), ``c`` the rounding error of those sums (compensated
    summation: a reduction folded in order, as XLA:CPU's is, adds one rounding per term, and over 152k terms the
    log-prob drifted by 3e-4 without it), and the larger ``best`` with its index and logit. Why one reduction: the
    compiler fuses it into the LM head's matrix product, so the ``[R, V]`` float32 logits are never written to
    memory and read back (compiled for a TPU at the GSM8K GRPO shape, a decoding step read 1.62x its bound with a
    draw, a log-sum-exp and the logits in memory, and 1.23x with this: ``python -m bench.decode_bound``; cutting
    the vocabulary into chunks instead of compensating broke that fusion: 2.29x). The log-sum-exp is summed in
    another order than ``jax.nn.logsumexp``: the log-probs agree with :func:`tempered_log_prob` to float32
    rounding, not bit for bit."""
    rows, vocab = logits.shape
    scaled = logits.astype(jnp.float32) / temperature
    noise = jax.vmap(lambda key: jax.random.gumbel(key, (1, vocab))[0])(keys)
    index = jax.lax.broadcasted_iota(jnp.int32, (rows, vocab), 1)

    def combine(a, b):
        m1, s1, c1, best1, i1, z1 = a
        m2, s2, c2, best2, i2, z2 = b
        m = jnp.maximum(m1, m2)
        shift = jnp.where(jnp.isneginf(m), jnp.zeros_like(m), m)  # two empty parts: exp(-inf - 0) = 0, not nan
        e1, e2 = jnp.exp(m1 - shift), jnp.exp(m2 - shift)
        a1, a2 = s1 * e1, s2 * e2
        total = a1 + a2
        back = total - a1
        error = (a1 - (total - back)) + (a2 - back)  # the exact rounding error of total (Knuth's two-sum)
        second = (best2 > best1) | ((best2 == best1) & (i2 < i1))
        return (m, total, c1 * e1 + c2 * e2 + error, jnp.where(second, best2, best1), jnp.where(second, i2, i1),
                jnp.where(second, z2, z1))

    zero = jnp.zeros_like(scaled)
    start = (np.float32(-np.inf), np.float32(0), np.float32(0), np.float32(-np.inf), np.int32(0), np.float32(0))
    m, s, c, _, tokens, chosen = jax.lax.reduce((scaled, zero + 1, zero, scaled + noise, index, scaled), start,
                                                combine, (1,))
    return tokens, chosen - (m + jnp.log(s + c))


def draw(keys: Array, steps: Array, logits: Array, params: SamplingParams) -> tuple[Array, Array]:
    """Token ``steps[r]`` of each row from ``logits [R, V]`` with the row keys ``keys [R]``: ``(tokens, log_probs)``.
    Without filters (and not greedy) in one pass over the logits (:func:`one_pass_draw`)."""
    vocab = logits.shape[-1]
    if not params.greedy and (params.top_k <= 0 or params.top_k >= vocab) and params.top_p >= 1.0:
        step_keys = jax.vmap(jax.random.fold_in)(keys, steps)
        return one_pass_draw(step_keys, logits, params.temperature)

    def one(key, step, row_logits):
        tokens, log_probs = sample_tokens(jax.random.fold_in(key, step), row_logits[None],
                                          temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                                          greedy=params.greedy)
        return tokens[0], log_probs[0]

    return jax.vmap(one)(keys, steps, logits)
