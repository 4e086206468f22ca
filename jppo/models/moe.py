"""A mixture of SwiGLU experts with a softmax top-k router, dropless, by grouped matrix products.

For a token ``x [D]`` with router kernel ``W_r [D, E]``:

    p = softmax(x W_r)  (float32 at least),   (w, e) = top_k(p),   w <- w / sum(w) if norm_topk_prob,
    y = sum_{j < k} w_j * swiglu_{e_j}(x),   swiglu_e(x) = (silu(x G_e) * (x U_e)) D_e.

Traced under a jppo mesh (``jax.set_mesh``), the mixture runs inside ``shard_map``, each device routing its own
tokens, and the experts are split over the mesh's ``expert`` axis, the tokens meeting them there
(:func:`expert_parallel`), with the same result.

Dropless: every token reaches its k experts whatever else shares its batch (no capacity, nothing dropped), so a
token's output never depends on the other tokens, and a gradient never on how its batch was cut. The ``N k``
(token, expert) pairs are sorted by expert and each expert's rows multiplied by its weights in one grouped product
(``jax.lax.ragged_dot``, group sizes = tokens per expert): the arrays are ``[N k, D]`` and ``[N k, F]``, linear in
the tokens. (On TPU and GPU ``ragged_dot`` is XLA's grouped product; jax's CPU lowering expands each group to a
masked dense product, ``E`` times the work and memory: fine for the tests' small models only.)

:class:`RouterStats` are the sums a load-balancing loss and the expert-load metrics are made of, over the valid
(non-padding) tokens; sums, so that the whole mini-batch's are the sums of its micro-batches'.
Routing replay: a forward pass hands each token's chosen experts to :func:`collect_routing` (the sampler records
them), and within :func:`replay_routing` routes each token by experts recorded elsewhere instead, its gate weights
still its own router's probabilities of them (:func:`route`).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jppo.models.attention import normalize, softmax, wide
from jppo.models.exchange import gather_routed, in_rounds
from jppo.parallel.mesh import EXPERT_AXIS, expert_shards, fitted_spec

Array = jax.Array


class RouterStats(NamedTuple):
    """Per layer with experts, over the valid tokens: ``counts [E]`` (tokens routed to each expert, each token
    counted once per expert among its top k) and ``probs [E]`` (the sum of the router's probabilities), float32;
    ``tokens`` (the number of valid tokens, a scalar); ``z``, the sum of ``logsumexp(router logits)^2`` (the
    z-loss's numerator). Stacked over the layers with experts: a leading axis."""

    counts: Array
    probs: Array
    tokens: Array
    z: Array


def route(x: Array, router: Array, top_k: int, norm_topk_prob: bool, replay: Array | None = None
          ) -> tuple[Array, Array, Array, Array]:
    """``(probs [N, E], weights [N, k], experts [N, k] int32, lse [N])`` of tokens ``x [N, D]``: the softmax of
    ``x W_r`` (float32, float64 for a float64 model), its ``k`` largest values (renormalized to sum 1 with
    ``norm_topk_prob``), their experts, and the logits' ``logsumexp`` (the z-loss's).

    Routing replay: with ``replay [N, k]`` (experts recorded elsewhere, e.g. by the sampler) a token goes to the
    recorded experts instead, weighted by this router's probabilities of them (renormalized the same way), so the
    router still gets a gradient; a token whose recorded ids are ``>= E`` (:func:`not_recorded`) keeps its own."""
    logits = (x @ router.astype(x.dtype)).astype(wide(x.dtype))
    probs = softmax(logits, axis=-1)  # (a product by 1 / sum in the bitwise mode: jppo.models.attention)
    weights, experts = jax.lax.top_k(probs, top_k)
    if replay is not None:
        recorded = jnp.all(replay < probs.shape[-1], axis=-1, keepdims=True)
        experts = jnp.where(recorded, replay.astype(experts.dtype), experts)
        weights = jnp.take_along_axis(probs, experts, axis=-1)  # the same numbers as top_k's where not replayed
    if norm_topk_prob:  # (replayed experts' probabilities may all underflow to 0: no 0/0 then)
        total = jnp.maximum(jnp.sum(weights, axis=-1, keepdims=True), jnp.finfo(weights.dtype).tiny)
        weights = normalize(weights, total)
    return probs, weights.astype(x.dtype), experts.astype(jnp.int32), jax.nn.logsumexp(logits, axis=-1)


def experts_swiglu(x: Array, experts: Array, weights: Array, gate: Array, up: Array, down: Array) -> Array:
    """``sum_j weights[n, j] swiglu_{experts[n, j]}(x[n])`` for ``x [N, D]``, ``gate``/``up [E, D, F]``,
    ``down [E, F, D]``, where a pair whose expert is outside ``[0, E)`` (held by another device of the ``expert``
    axis) adds nothing: the ``N k`` pairs sorted by expert (stable, the others last), three grouped products over
    the groups of ``[0, E)``, unsorted back."""
    tokens, top_k = experts.shape
    num_experts = gate.shape[0]
    flat = experts.reshape(-1)
    held = (flat >= 0) & (flat < num_experts)
    flat = jnp.where(held, flat, num_experts)
    order = jnp.argsort(flat, stable=True)
    rows = x[order // top_k]  # [N k, D], grouped by expert
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)  # the others' pairs in no group
    hidden = jax.nn.silu(jax.lax.ragged_dot(rows, gate, sizes)) * jax.lax.ragged_dot(rows, up, sizes)
    out = jnp.where(held[order][:, None], jax.lax.ragged_dot(hidden, down, sizes), 0)  # [N k, D]
    out = out[jnp.argsort(order)].reshape(tokens, top_k, -1)  # back to (token, j) order
    return jnp.einsum("nkd,nk->nd", out, weights.astype(out.dtype))


def moe_mlp(x: Array, valid: Array, router: Array, gate: Array, up: Array, down: Array, top_k: int,
            norm_topk_prob: bool, replay: Array | None = None, chunk: int = 0) -> tuple[Array, RouterStats, Array]:
    """The mixture on ``x [B, T, D]`` with ``valid [B, T]`` (the non-padding tokens, for the stats only: padding
    is routed too, its output unused), the :class:`RouterStats` of the valid tokens and each token's experts
    ``[B, T, k]`` int32; ``replay [B, T, k]``: the experts to route by (:func:`route`).

    Under a jppo mesh it is :func:`expert_parallel`, also where ``mesh.expert`` is 1: each device then sorts and
    multiplies its own tokens' pairs, where XLA, partitioning the global sort of every token's pairs, would gather
    the tokens (on a data-parallel TPU mesh: 4 all-reduces per decoded token, the experts' work on every device).
    The weights are cast before, so that ``fsdp`` gathers them in the compute dtype. ``chunk``: the exchange's
    tokens per device per round (:func:`expert_parallel`; 0: one round)."""
    gate, up, down = (w.astype(x.dtype) for w in (gate, up, down))
    if EXPERT_AXIS in jax.sharding.get_abstract_mesh().shape:  # a jppo mesh set at trace time
        return expert_parallel(x, valid, router, gate, up, down, top_k, norm_topk_prob, replay, chunk)
    batch, length, width = x.shape
    flat = x.reshape(-1, width)
    probs, weights, experts, lse = route(flat, router, top_k, norm_topk_prob, flat_replay(replay))
    out = experts_swiglu(flat, experts, weights, gate, up, down)
    return (out.reshape(batch, length, width), router_stats(probs, experts, valid.reshape(-1), lse),
            experts.reshape(batch, length, top_k))


def flat_replay(replay: Array | None) -> Array | None:
    """``[B, T, k] -> [B T, k]``, None passed on."""
    return None if replay is None else replay.reshape(-1, replay.shape[-1])


def router_stats(probs: Array, experts: Array, keep: Array, lse: Array) -> RouterStats:
    """The :class:`RouterStats` of tokens with router ``probs [N, E]``, chosen ``experts [N, k]`` and logits'
    ``logsumexp`` ``lse [N]``, over those ``keep [N]`` holds."""
    one_hot = jax.nn.one_hot(experts, probs.shape[-1], dtype=probs.dtype).sum(axis=1)  # [N, E]
    return RouterStats(
        counts=jnp.sum(jnp.where(keep[:, None], one_hot, 0.0), axis=0),
        probs=jnp.sum(jnp.where(keep[:, None], probs, 0.0), axis=0),
        tokens=jnp.sum(keep).astype(probs.dtype),
        z=jnp.sum(jnp.where(keep, jnp.square(lse), 0.0)),
    )


def expert_parallel(x: Array, valid: Array, router: Array, gate: Array, up: Array, down: Array, top_k: int,
                    norm_topk_prob: bool, replay: Array | None = None, chunk: int = 0
                    ) -> tuple[Array, RouterStats, Array]:
    """:func:`moe_mlp` with the experts split over the ``expert`` axis of the mesh set at trace time, ``E / e``
    experts per device (``e`` the axis' size), inside ``shard_map``. Each device routes its own tokens (``n`` of
    them), then, dropless, with no capacity:

        all-gather over ``expert``: the group's tokens ``[e n, D]``, their weights and experts ``[e n, k]``
            (one collective, :func:`gather_routed`);
        y_partial = experts_swiglu over the pairs whose expert this device holds (the others add 0);
        reduce-scatter over ``expert``: each device's ``n`` outputs summed over the group's devices;

    then a ``psum`` over ``tensor`` where the experts' width is split over it. Every token reaches its ``k``
    experts whatever the routing, so the output is the unsharded one up to summation order, and the gradient the
    transposes' (a reduce-scatter of the gathered tokens' cotangents, an all-gather of the outputs'). Rows the mesh
    does not split over ``expert`` (replicated there) are not gathered: each device takes its experts' share of
    every row, and a ``psum`` adds the shares. The stats are summed over the axes that split the tokens: global
    (inside an enclosing ``shard_map``, such as the decoding loop's, over the axes it left free: along its manual
    axes each device's rows are its own).

    The gathered exchange holds ``e n k`` pairs per device, growing with the group. With ``0 < chunk < n`` it runs
    in rounds of ``chunk`` of each device's tokens (the last padded with tokens of weight 0), one after another
    (``lax.map``), each round recomputed in the backward pass (``jax.checkpoint``): a layer holds ``e chunk k``
    pairs at a time, and keeps only its tokens, weights and experts for the backward pass. A token's output is its
    own experts' sum whatever round it is in: the same numbers, up to the rounding of other matmul shapes.

    Why not ``ragged_all_to_all`` (the pairs sent to their experts' devices): XLA:CPU has no kernel for it, and a
    dropless exchange needs a worst-case receive buffer of ``e n k`` rows anyway; the gather moves ``(e - 1) n``
    rows per device each way, which for ``k >= e`` is no more than the ``k (e - 1) / e n`` an all-to-all moves."""
    mesh = jax.sharding.get_abstract_mesh()
    shape, manual = dict(mesh.shape), mesh.manual_axes  # manual: an enclosing shard_map's (each device's rows)
    shards, num_experts = expert_shards(shape), gate.shape[0]
    if num_experts % shards:
        raise ValueError(f"mesh.expert={shards} must divide num_experts={num_experts}")
    if EXPERT_AXIS in manual:
        raise ValueError("the expert axis must not be manual around a mixture: its experts are split over it")
    x_spec = fitted_spec(x.shape, ("batch", "length", None), shape, manual)
    token_axes = tuple(axis for axes in x_spec[:2] for axis in ((axes,) if isinstance(axes, str) else (axes or ())))
    gathered = EXPERT_AXIS in token_axes
    # the tensor axis where it divides the experts' width
    width = fitted_spec(gate.shape[-1:], ("mlp",), shape, manual)[0]
    local_experts = num_experts // shards

    def local(x, valid, router, gate, up, down, replay):
        batch, length, hidden = x.shape
        flat = x.reshape(-1, hidden)
        probs, weights, experts, lse = route(flat, router, top_k, norm_topk_prob, flat_replay(replay))
        chosen = experts.reshape(batch, length, top_k)
        stats = router_stats(probs, experts, valid.reshape(-1), lse)
        if token_axes:
            stats = jax.tree.map(lambda s: jax.lax.psum(s, token_axes), stats)
        first = jax.lax.axis_index(EXPERT_AXIS) * local_experts

        def exchange(flat, weights, experts):  # one round: the group's tokens to the experts and back
            if gathered:
                flat, weights, experts = gather_routed(flat, weights, experts, num_experts)
            out = experts_swiglu(flat, experts - first, weights, gate, up, down)
            if gathered:
                return jax.lax.psum_scatter(out, EXPERT_AXIS, scatter_dimension=0, tiled=True)
            return jax.lax.psum(out, EXPERT_AXIS)

        if gathered and 0 < chunk < flat.shape[0]:
            out = in_rounds(jax.checkpoint(exchange), chunk, flat, weights, experts)
        else:
            out = exchange(flat, weights, experts)
        if width is not None:
            out = jax.lax.psum(out, width)
        return out.reshape(batch, length, hidden), stats, chosen

    expert_spec = PartitionSpec(EXPERT_AXIS, None, width)
    return jax.shard_map(
        local, mesh=mesh,
        in_specs=(x_spec, PartitionSpec(*x_spec[:2]), PartitionSpec(), expert_spec, expert_spec,
                  PartitionSpec(EXPERT_AXIS, width, None), PartitionSpec(*x_spec[:2])),
        out_specs=(x_spec, PartitionSpec(), PartitionSpec(*x_spec[:2])),
        axis_names=frozenset(shape) - frozenset(manual),
    )(x, valid, router, gate, up, down, replay)


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
def _collecting(var: contextvars.ContextVar) -> Iterator[list]:
    """A new list set in ``var`` for the block (the previous one back after it), yielded."""
    collected: list = []
    token = var.set(collected)
    try:
        yield collected
    finally:
        var.reset(token)


def collect_router_stats() -> contextlib.AbstractContextManager[list[RouterStats]]:
    """Within it, each forward pass of a model with experts appends its :class:`RouterStats` (stacked over the
    layers with experts) to the list it yields: traced values, to be used in the function being traced (a loss)."""
    return _collecting(_COLLECTED)


def record_router_stats(stats: RouterStats) -> None:
    """Hands a forward pass's stats to the innermost :func:`collect_router_stats`, if any."""
    collected = _COLLECTED.get()
    if collected is not None:
        collected.append(stats)


# Routing replay: what the sampler records (each forward pass's experts, stacked over the layers with experts, in
# call order) and what the trainer's forward passes route by, handed over at trace time like the router stats.
_ROUTED: contextvars.ContextVar[list | None] = contextvars.ContextVar("jppo_routed_experts", default=None)
_REPLAYED: contextvars.ContextVar[Array | None] = contextvars.ContextVar("jppo_replayed_experts", default=None)


def collect_routing() -> contextlib.AbstractContextManager[list[Array]]:
    """Within it, each forward pass of a model with experts run layer by layer (the sampler's prefill and decoding
    steps) or by one scan appends its experts ``[Ls, B, T, k]`` int32 (``Ls`` layers with experts) to the list it
    yields (traced values, for the function being traced)."""
    return _collecting(_ROUTED)


def record_routing(experts: Array | list[Array]) -> None:
    """Hands a forward pass's experts ``[Ls, B, T, k]`` (or the list of its layers', stacked here; none: nothing)
    to the innermost :func:`collect_routing`, if any."""
    collected = _ROUTED.get()
    if collected is not None and len(experts):
        collected.append(jnp.stack(experts) if isinstance(experts, list) else experts)


@contextlib.contextmanager
def replay_routing(experts: Array | None) -> Iterator[None]:
    """Within it, the forward passes of a model with experts route token ``(b, t)`` at its ``l``-th layer with
    experts by ``experts[b, t, l]`` (``[B, T, Ls, k]``, ids ``>= E``: not recorded, the router's own choice;
    :func:`route`); None: no replay (also inside an outer one)."""
    token = _REPLAYED.set(experts)
    try:
        yield
    finally:
        _REPLAYED.reset(token)


def replayed_routing() -> Array | None:
    """The :func:`replay_routing` in force as ``[Ls, B, T, k]`` (one layer per step of a scan), or None."""
    experts = _REPLAYED.get()
    return None if experts is None else jnp.moveaxis(experts, 2, 0)


def routing_dtype(num_experts: int) -> jnp.dtype:
    """The compact dtype of recorded expert ids: uint8 up to 255 experts (one value left for :func:`not_recorded`),
    else uint16."""
    return jnp.dtype(jnp.uint8 if num_experts < 256 else jnp.uint16)


def not_recorded(num_experts: int) -> int:
    """The id that marks a token whose experts were not recorded (its largest value in :func:`routing_dtype`)."""
    return int(jnp.iinfo(routing_dtype(num_experts)).max)


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
            (normal((Ls, E, D, F)), ("layers", "experts", "embed", "mlp")),
            (normal((Ls, E, D, F)), ("layers", "experts", "embed", "mlp")),
            (normal((Ls, E, F, D)), ("layers", "experts", "mlp", "embed")))


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


def run_layers(layer: Callable, hidden: Array, stacked: dict[str, Array], adapters: dict, config) -> tuple[Array, Any]:
    """Every layer of a decoder, ``layer`` (``(h, (weights, adapters, replay)) -> (h, out)``) on its slice of the
    ``stacked`` weights and ``adapters``: by one ``lax.scan`` (unrolled with ``layer_loop: unroll``), or, layers
    with and without experts side by side, one after the other (:func:`layer_by_layer`). The layers with experts
    route by the experts of :func:`replay_routing` when one is in force, and hand their stats and experts to
    :func:`record_router_stats` and :func:`record_routing`. The final ``h`` and every layer's ``extra``, stacked."""
    replay = replayed_routing() if config.sparse_layers else None
    if config.dense_layers and config.sparse_layers:
        return layer_by_layer(layer, hidden, layer_slices(stacked, adapters, config), replay)
    unroll = config.resolved_layer_loop == "unroll"
    hidden, extra = jax.lax.scan(layer, hidden, (stacked, adapters, replay), unroll=unroll)
    if config.sparse_layers:
        extra, (stats, experts) = extra
        record_router_stats(stats)
        record_routing(experts)
    return hidden, extra


def layer_by_layer(layer: Callable, hidden: Array, slices: tuple[tuple[dict, dict], ...],
                   replay: Array | None = None) -> tuple[Array, Any]:
    """``layer`` (``(h, (weights, adapters, replay)) -> (h, out)``, ``out = (extra, (stats, experts))`` in a layer
    with experts) run on each layer's :func:`layer_slices` in turn, for layers that differ in their weights, the
    ``l``-th layer with experts replaying ``replay[l]`` (``[Ls, B, T, k]`` or None): the final ``h`` and every
    layer's ``extra`` stacked, the stats and experts of those with experts handed to :func:`record_router_stats`
    and :func:`record_routing`."""
    extras, stats, routed = [], [], []
    for weights, adapters in slices:
        sparse = "router" in weights
        layer_replay = replay[len(stats)] if sparse and replay is not None else None
        hidden, out = layer(hidden, (weights, adapters, layer_replay))
        if sparse:
            out, (layer_stats, experts) = out
            stats.append(layer_stats)
            routed.append(experts)
        extras.append(out)
    record_router_stats(stack_layers(stats))
    record_routing(jnp.stack(routed))
    return hidden, stack_layers(extras)
