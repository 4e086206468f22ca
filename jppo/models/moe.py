"""A mixture of SwiGLU experts with a softmax top-k router, dropless, by grouped matrix products.

For a token ``x [D]`` with router kernel ``W_r [D, E]``:

    p = softmax(x W_r)  (float32 at least),   (w, e) = top_k(p),   w <- w / sum(w) if norm_topk_prob,
    y = sum_{j < k} w_j * swiglu_{e_j}(x),   swiglu_e(x) = (silu(x G_e) * (x U_e)) D_e.

Dropless: every token reaches its k experts whatever else shares its batch (no capacity, nothing dropped), so a
token's output never depends on the other tokens, and a gradient never on how its batch was cut. The ``N k``
(token, expert) pairs are sorted by expert and each expert's rows multiplied by its weights in one grouped product
(``jax.lax.ragged_dot``, group sizes = tokens per expert): the arrays are ``[N k, D]`` and ``[N k, F]``, linear in
the tokens. (On TPU and GPU ``ragged_dot`` is XLA's grouped product; jax's CPU lowering expands each group to a
masked dense product, ``E`` times the work and memory: fine for the tests' small models only.)

:class:`RouterStats` are the sums a load-balancing loss and the expert-load metrics are made of, over the valid
(non-padding) tokens; sums, so that the whole mini-batch's are the sums of its micro-batches'.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator, NamedTuple

import jax
import jax.numpy as jnp

from jppo.models.attention import wide

Array = jax.Array


class RouterStats(NamedTuple):
    """Per layer with experts, over the valid tokens: ``counts [E]`` (tokens routed to each expert, each token
    counted once per expert among its top k) and ``probs [E]`` (the sum of the router's probabilities), float32;
    ``tokens`` (the number of valid tokens, a scalar). Stacked over the layers with experts: a leading axis."""

    counts: Array
    probs: Array
    tokens: Array


def route(x: Array, router: Array, top_k: int, norm_topk_prob: bool) -> tuple[Array, Array, Array]:
    """``(probs [N, E], weights [N, k], experts [N, k] int32)`` of tokens ``x [N, D]``: the softmax of ``x W_r``
    (float32, float64 for a float64 model), its ``k`` largest values (renormalized to sum 1 with
    ``norm_topk_prob``) and their experts."""
    logits = x @ router.astype(x.dtype)
    probs = jax.nn.softmax(logits.astype(wide(x.dtype)), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return probs, weights.astype(x.dtype), experts.astype(jnp.int32)


def experts_swiglu(x: Array, experts: Array, weights: Array, gate: Array, up: Array, down: Array) -> Array:
    """``sum_j weights[n, j] swiglu_{experts[n, j]}(x[n])`` for ``x [N, D]``, ``gate``/``up [E, D, F]``,
    ``down [E, F, D]``: the ``N k`` pairs sorted by expert (stable), three grouped products, unsorted back."""
    tokens, top_k = experts.shape
    num_experts = gate.shape[0]
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    rows = x[order // top_k]  # [N k, D], grouped by expert
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    hidden = jax.nn.silu(jax.lax.ragged_dot(rows, gate, sizes)) * jax.lax.ragged_dot(rows, up, sizes)
    out = jax.lax.ragged_dot(hidden, down, sizes)  # [N k, D]
    out = out[jnp.argsort(order)].reshape(tokens, top_k, -1)  # back to (token, j) order
    return jnp.einsum("nkd,nk->nd", out, weights.astype(out.dtype))


def moe_mlp(x: Array, valid: Array, router: Array, gate: Array, up: Array, down: Array, top_k: int,
            norm_topk_prob: bool) -> tuple[Array, RouterStats]:
    """The mixture on ``x [B, T, D]`` with ``valid [B, T]`` (the non-padding tokens, for the stats only: padding
    is routed too, its output unused) and the :class:`RouterStats` of the valid tokens."""
    batch, length, width = x.shape
    flat = x.reshape(-1, width)
    probs, weights, experts = route(flat, router, top_k, norm_topk_prob)
    dtype = x.dtype
    out = experts_swiglu(flat, experts, weights, gate.astype(dtype), up.astype(dtype), down.astype(dtype))
    keep = valid.reshape(-1)
    one_hot = jax.nn.one_hot(experts, router.shape[-1], dtype=probs.dtype).sum(axis=1)  # [N, E]
    stats = RouterStats(
        counts=jnp.sum(jnp.where(keep[:, None], one_hot, 0.0), axis=0),
        probs=jnp.sum(jnp.where(keep[:, None], probs, 0.0), axis=0),
        tokens=jnp.sum(keep).astype(probs.dtype),
    )
    return out.reshape(batch, length, width), stats


def load_balancing_loss(counts: Array, probs: Array, tokens: Array, num_experts: int) -> Array:
    """transformers' ``load_balancing_loss_func`` (Switch Transformer's, pooled over the layers with experts) from
    :class:`RouterStats` summed over a batch: with ``R = layers * tokens`` (token-layer pairs),
    ``f_e = sum_layers counts_e / R`` and ``P_e = sum_layers probs_e / R``, the loss is ``E sum_e f_e P_e``
    (``k`` when the load is even). ``counts``/``probs [layers, E]``, ``tokens [layers]``."""
    pairs = jnp.maximum(jnp.sum(tokens), 1.0)
    fractions = jnp.sum(counts, axis=0) / pairs
    return num_experts * jnp.sum(fractions * jnp.sum(probs, axis=0) / pairs)


# The (layer-stacked) RouterStats of each model call made inside collect_router_stats(), in call order.
_COLLECTED: contextvars.ContextVar[list | None] = contextvars.ContextVar("jppo_router_stats", default=None)


@contextlib.contextmanager
def collect_router_stats() -> Iterator[list[RouterStats]]:
    """Within it, each forward pass of a model with experts appends its :class:`RouterStats` (stacked over the
    layers with experts) to the list it yields: traced values, to be used in the function being traced (a loss)."""
    collected: list[RouterStats] = []
    token = _COLLECTED.set(collected)
    try:
        yield collected
    finally:
        _COLLECTED.reset(token)


def record_router_stats(stats: RouterStats) -> None:
    """Hands a forward pass's stats to the innermost :func:`collect_router_stats`, if any."""
    collected = _COLLECTED.get()
    if collected is not None:
        collected.append(stats)


def stack_layers(trees: list) -> Any:
    """Per-layer pytrees stacked on a new leading axis."""
    return jax.tree.map(lambda *x: jnp.stack(x), *trees)


def expert_params(config, normal: Callable[[tuple[int, ...]], Array]) -> tuple[tuple[Array | None, tuple], ...]:
    """``(value, logical names)`` of the router ``[Ls, D, E]`` and the experts' gate and up ``[Ls, E, D, F]`` and
    down ``[Ls, E, F, D]`` kernels (``Ls`` layers with experts, ``F = moe_intermediate_size``), drawn by
    ``normal(shape)``; ``(None, ())`` each for a model without experts."""
    Ls = len(config.sparse_layers)
    if not Ls:
        return ((None, ()),) * 4
    D, E, F = config.hidden_size, config.num_experts, config.moe_intermediate_size
    return ((normal((Ls, D, E)), ("layers", "embed", None)),
            (normal((Ls, E, D, F)), ("layers", None, "embed", "mlp")),
            (normal((Ls, E, D, F)), ("layers", None, "embed", "mlp")),
            (normal((Ls, E, F, D)), ("layers", None, "mlp", "embed")))


DENSE_MLP = ("gate_proj", "up_proj", "down_proj")
EXPERTS = ("router", "expert_gate", "expert_up", "expert_down")


def stacked_layers(name: str, config) -> tuple[int, ...]:
    """The layers the stack of the layers' parameter ``name`` holds, in order."""
    if name in DENSE_MLP:
        return config.dense_layers
    if name in EXPERTS:
        return config.sparse_layers
    return tuple(range(config.num_layers))


def layer_slices(stacked: dict[str, Array], adapters: dict[str, tuple[Array, Array]], config
                 ) -> tuple[tuple[dict, dict], ...]:
    """Each layer's ``(weights, adapters)`` out of the stacks: the dense MLP's stacks hold the dense layers only
    and the experts' the layers with experts, every other stack all layers."""
    dense, sparse = config.dense_layers, config.sparse_layers
    out = []
    for i in range(config.num_layers):
        weights = {}
        for name, w in stacked.items():
            if name in DENSE_MLP:
                if i in dense:
                    weights[name] = w[dense.index(i)]
            elif name in EXPERTS:
                if i in sparse:
                    weights[name] = w[sparse.index(i)]
            else:
                weights[name] = w[i]
        out.append((weights, {name: (a[i], b[i]) for name, (a, b) in adapters.items()}))
    return tuple(out)


def layer_by_layer(layer: Callable, hidden: Array, slices: tuple[tuple[dict, dict], ...]) -> tuple[Array, Any]:
    """``layer`` (``(h, (weights, adapters)) -> (h, out)``, ``out = (extra, stats)`` in a layer with experts) run on
    each layer's :func:`layer_slices` in turn, for layers that differ in their weights: the final ``h`` and every
    layer's ``extra`` stacked, the stats of those with experts handed to :func:`record_router_stats`."""
    extras, stats = [], []
    for weights, adapters in slices:
        hidden, out = layer(hidden, (weights, adapters))
        if "router" in weights:
            out, layer_stats = out
            stats.append(layer_stats)
        extras.append(out)
    record_router_stats(stack_layers(stats))
    return hidden, stack_layers(extras)
