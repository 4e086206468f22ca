"""One optimizer step of the actor or the critic, as one jitted pure function of (state, micro-batches).

Read from the top, one call of :class:`UpdateStep` runs :func:`optimizer_steps`: a ``lax.scan`` over its M
mini-batches, each one :func:`optimizer_step` on K micro-batches:

1. the whole mini-batch's :class:`~jppo.core.masked.NormStats` are computed ONCE (:func:`mini_batch_norm`), by
   ``psum`` of shard-local counts over the batch axes in a ``shard_map`` region (:func:`mini_batch_norm_stats`),
   before any micro-batch is touched; for a model with experts and a load-balancing loss, also the whole
   mini-batch's expert fractions, by a forward pass over its micro-batches
   (:func:`jppo.engine.experts.mini_batch_expert_fractions`);
2. ``lax.scan`` runs the K micro-batches: each differentiates its share of the whole loss
   (:func:`micro_batch_gradient` of :func:`micro_batch_share`: every term through ``agg_loss`` with those same
   NormStats) and adds the gradient to the running sum (:func:`summed_gradient`), the accumulator of
   ``optax.MultiSteps(use_grad_mean=False)``; after the K-th the optimizer runs once, on the whole mini-batch
   gradient (:func:`~jppo.engine.optim.apply_accumulated`), and no micro-batch does the optimizer's work;
3. metrics are :class:`~jppo.core.metrics.Metric` pairs summed over the scan (and, being sums over global arrays,
   over shards), divided once at the end (:func:`step_metrics`).

Micro-batches without a single response token (padding to a common K) skip the forward and backward pass: their
share and gradient are exactly zero anyway (with experts, those without a single token: every token is routed).

``normalization="per_micro_batch"`` reproduces, on purpose and per role, what verl computed before it normalized
globally: each micro-batch normalized by its own counts (N and S over all shards; C as configured), the critic's
shares summed, the actor's averaged (:func:`legacy_share_divisor`); loss metrics are means of micro-batch values.

The roles' losses themselves (what a share is) are :mod:`jppo.engine.objectives`; the optimizer that receives the
summed gradient is :mod:`jppo.engine.optim`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from jppo.core import metrics as metrics_lib
from jppo.core.masked import NormStats, global_norm_stats
from jppo.engine.bitwise import bitwise_gradient, check_bitwise
from jppo.engine.config import ActorConfig, CriticConfig, UpdateConfig, require_engine_config
from jppo.engine.experts import mini_batch_expert_fractions, router_aux_coef, router_z_coef
from jppo.engine.layout import flatten_shards
from jppo.engine.objectives import Batch, LossFn
from jppo.engine.optim import (
    accumulator_dtype,
    apply_accumulated,
    check_optim,
    inner_optimizer,
    learning_rate_schedule,
    step_report,
    without_accumulator,
)
from jppo.engine.state import TrainState
from jppo.models.attention import normalized_by_product
from jppo.parallel.mesh import BATCH_AXES, ROW_AXES, SEQUENCE_AXIS, sequence_shards

log = logging.getLogger(__name__)

Grads = Any  # a gradient: the trained parameters' tree
Metrics = dict[str, metrics_lib.Metric]


class UpdateStep:
    """The jitted update: ``(state, steps) -> (state, metrics, gradients)`` for M optimizer steps in one call.

    ``steps`` holds ``[M, K, D, ...]`` arrays (:func:`jppo.engine.microbatch.stack_micro_batches`); ``lax.scan``
    runs the M mini-batches one after another (:func:`optimizer_steps`), so a whole ``ppo_epochs`` x mini-batches
    update is one dispatch, and the compiled program does not depend on M beyond its loop count. State buffers are
    donated and come back laid out exactly as they went in (frozen parameters are an input that is not donated:
    they come back as the same arrays, so a reference policy may read them); metrics come back per step, ``[M]``.
    ``gradients``: with ``keep_gradient`` (and a state made with ``init_train_state(..., keep_gradient=True)``) the
    accumulated gradient of each optimizer step, stacked ``[M, ...]`` (what ``jppo.audit`` and the tests compare);
    otherwise None.
    """

    def __init__(
        self, graphdef: nnx.GraphDef, loss: LossFn, cfg: UpdateConfig, mesh: Mesh, role: str,
        keep_gradient: bool = False,
    ):
        warn_legacy_normalization(cfg, role)
        self._one_step = make_update_step(graphdef, loss, cfg, mesh, role, keep_gradient)
        self._mesh = mesh
        self._jitted: Any = None

    def _steps(self, state: TrainState, frozen: Optional[nnx.State], batches: Batch):
        """The program that is jitted: :func:`optimizer_steps` of this role's :func:`optimizer_step`."""
        return optimizer_steps(self._one_step, state, frozen, batches)

    def _program(self, trained: TrainState):
        if self._jitted is None:
            state_shardings = jax.tree.map(lambda x: x.sharding, trained)
            self._jitted = jax.jit(self._steps, donate_argnums=(0,), out_shardings=(state_shardings, None, None))
        return self._jitted

    def __call__(self, state: TrainState, steps: Batch) -> tuple[TrainState, dict[str, jax.Array], Any]:
        frozen, trained = state.frozen, state.replace(frozen=None)
        with jax.set_mesh(self._mesh):
            new, metrics, gradients = self._program(trained)(trained, frozen, steps)
        return new.replace(frozen=frozen), metrics, gradients

    def lower(self, state: TrainState, steps: Batch) -> jax.stages.Lowered:
        """The program :meth:`__call__` runs, lowered for ``state`` and ``steps`` (arrays, or ``ShapeDtypeStruct``
        leaves with shardings: :func:`jppo.engine.state.abstract_train_state`) on this step's mesh, which may be
        made of another machine's devices; ``.compile()`` it for that machine's compiler."""
        frozen, trained = state.frozen, state.replace(frozen=None)
        with jax.set_mesh(self._mesh):
            return self._program(trained).lower(trained, frozen, steps)


def optimizer_steps(
    one_step: Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array], Any]],
    state: TrainState, frozen: Optional[nnx.State], batches: Batch,
) -> tuple[TrainState, dict[str, jax.Array], Any]:
    """M optimizer steps in one program: ``lax.scan`` of ``one_step`` (:func:`make_update_step`'s) over the
    mini-batches of ``batches`` (``[M, K, D, ...]``), the train state carried from one to the next; metrics
    ``[M]`` and gradients ``[M, ...]`` stacked. The ``frozen`` parameters are read by every step but not carried
    (nor donated): they leave the state between steps."""

    def body(carry: TrainState, batch: Batch):
        carry, metrics, gradient = one_step(carry.replace(frozen=frozen), batch)
        return carry.replace(frozen=None), (metrics, gradient)

    state, (metrics, gradients) = jax.lax.scan(body, state, batches)
    return state, metrics, gradients


def make_update_step(
    graphdef: nnx.GraphDef, loss: LossFn, cfg: UpdateConfig, mesh: Mesh, role: str, keep_gradient: bool = False
) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array], Any]]:
    """A pure ``(state, micro_batches) -> (state, metrics, gradient)`` for one mini-batch (C: ``cfg``'s) of
    ``role`` (``actor``/``critic``, the prefix of its metric names): :func:`optimizer_step` with these settings,
    which are checked here, before anything is traced.

    ``micro_batches`` holds ``[K, D, ...]`` arrays (see :mod:`jppo.engine.microbatch`); K is read from their shape. Each
    micro-batch's gradient goes to ``optax.MultiSteps(every_k_schedule=K, use_grad_mean=False)``, which sums them
    and applies the optimizer once, on the K-th. ``gradient`` is the accumulated gradient the optimizer received,
    as recorded by the optimizer itself (``keep_gradient``, with a state from ``init_train_state(...,
    keep_gradient=True)``), else None.
    """
    require_engine_config(cfg, for_update=True)
    check_optim(cfg.optim)
    check_bitwise(cfg, mesh)
    return functools.partial(
        optimizer_step, graphdef=graphdef, loss=loss, cfg=cfg, mesh=mesh, role=role, keep_gradient=keep_gradient
    )


def optimizer_step(
    state: TrainState, batch: Batch, *, graphdef: nnx.GraphDef, loss: LossFn, cfg: UpdateConfig, mesh: Mesh,
    role: str, keep_gradient: bool = False,
) -> tuple[TrainState, dict[str, jax.Array], Any]:
    """One optimizer step on the K micro-batches ``[K, D, ...]`` of one mini-batch:

    1. ``norm``: the whole mini-batch's N, S and C (and expert fractions), once (:func:`mini_batch_norm`);
    2. for k = 1 .. K (``lax.scan``): ``g_k = d share_k / d params`` (:func:`micro_batch_gradient`), where
       ``share_k`` is micro-batch k's share of the loss under ``norm``, so ``sum_k share_k`` is the whole
       mini-batch's loss; ``g_k`` is added to MultiSteps' accumulator (:func:`summed_gradient`), in its dtype
       (float32 at least, so the sum reaches the optimizer unrounded), and then the optimizer runs once on
       ``sum_k g_k`` (:func:`~jppo.engine.optim.apply_accumulated`);
    3. the metric pairs summed over k, divided once (:func:`step_metrics`).

    ``state.step`` counts the step unless the optimizer skipped it as non-finite.
    """
    inner = inner_optimizer(cfg.optim, keep_gradient, cfg.optimizer_steps_per_training_step)
    model = trained_model(graphdef, state.params, state.frozen)  # the step's starting weights
    with normalized_by_product() if cfg.bitwise else contextlib.nullcontext():  # bitwise: the counts route as the rows
        norm = mini_batch_norm(model, batch, cfg, mesh)
    share_gradient_of = functools.partial(share_gradient, frozen=state.frozen, graphdef=graphdef, loss=loss, norm=norm)
    shapes = jax.eval_shape(share_gradient_of, state.params, jax.tree.map(lambda x: x[0], batch))  # (grads, metrics)
    # with experts, a micro-batch holding a token (if not a response token) routes it: for its share, the expert load
    routes = isinstance(cfg, ActorConfig) and bool(model.config.sparse_layers)
    dtype, held = accumulator_dtype(state.params), state.opt_state.acc_grads is not None
    if cfg.bitwise:  # the rows' gradients summed in one fixed tree, then the optimizer (jppo.engine.bitwise)
        with normalized_by_product():
            grads, total = bitwise_gradient(share_gradient_of, state.params, batch, mesh, dtype, routes)
    else:
        grads, total = summed_gradient(share_gradient_of, state.params, batch, shapes, routes, dtype,
                                       state.opt_state.acc_grads)
    params, opt_state = apply_accumulated(inner, grads, without_accumulator(state.opt_state), state.params)
    if held:  # the accumulator the state holds comes back empty (zeros), as MultiSteps leaves it after its K-th
        opt_state = opt_state._replace(acc_grads=jax.tree.map(jnp.zeros_like, state.opt_state.acc_grads))
    report = step_report(opt_state)
    applied = jnp.logical_not(report["skipped"])
    schedule = learning_rate_schedule(cfg.optim, cfg.optimizer_steps_per_training_step)
    values = step_metrics(total, report, schedule, state.opt_state.gradient_step, role)
    new_state = TrainState(
        params=params, opt_state=opt_state, step=state.step + applied.astype(jnp.int32), frozen=state.frozen
    )
    return new_state, values, report["gradient"]


def summed_gradient(
    share_gradient_of: Callable[[nnx.State, Batch], tuple[Grads, Metrics]], params: nnx.State, batch: Batch,
    shapes: Any, routes: bool, dtype, start: Optional[Grads] = None,
) -> tuple[Grads, Metrics]:
    """``start + g_1 + ... + g_K`` in the accumulator's ``dtype`` (float32 at least, so the sum reaches the optimizer
    unrounded), added in micro-batch order, and the metric pairs summed over k: a ``lax.scan`` over the micro-batches
    of ``batch`` (``[K, D, ...]``) carrying only the running sums. The parameters are read by every micro-batch and
    carried by none, so XLA keeps one copy of them and of the optimizer state: a loop carrying the whole state, as
    applying the optimizer on the K-th micro-step inside it would, holds a second copy of both on a GPU (compiled
    for h200x8, Qwen3-30B-A3B's update: 12 stacks of its experts' float32 state, 54 GiB a device). ``start``: the
    state's accumulator (zeros between steps), or None: a sum of its own from zeros (none for one micro-batch)."""
    cast = lambda grads: jax.tree.map(lambda g: g.astype(dtype), grads)  # noqa: E731
    if batch.slots.response_mask.shape[0] == 1 and start is None:  # one micro-batch: its gradient is the sum
        grads, total = micro_batch_gradient(share_gradient_of, params, jax.tree.map(lambda x: x[0], batch), shapes,
                                            routes)
        return cast(grads), total

    def micro_step(carry, micro: Batch):
        """Scan's body: micro-batch k's gradient and metric pairs into the running sums."""
        acc, total = carry
        grads, metrics = micro_batch_gradient(share_gradient_of, params, micro, shapes, routes)
        return (jax.tree.map(jnp.add, acc, cast(grads)), metrics_lib.combine(total, metrics)), None

    if start is None:
        start = jax.tree.map(lambda p: jnp.zeros_like(p, dtype), params)
    (acc, total), _ = jax.lax.scan(micro_step, (start, _zeros(shapes[1])), batch)
    return acc, total


# 1. once per optimizer step: what every micro-batch's share is normalized by


@dataclasses.dataclass(frozen=True)
class MiniBatchNorm:
    """What each micro-batch's share of the loss is normalized by, fixed once per optimizer step
    (:func:`mini_batch_norm`): the whole mini-batch's NormStats ``whole``; or, in the legacy mode (``whole`` None),
    the micro-batch's own counts with C ``loss_scale_factor``, the share then divided by ``divisor``."""

    whole: Optional[NormStats]
    divisor: Optional[jax.Array]
    loss_scale_factor: float


def mini_batch_norm(model: nnx.Module, batch: Batch, cfg: UpdateConfig, mesh: Mesh) -> MiniBatchNorm:
    """The normalizers of the mini-batch ``batch`` (``[K, D, ...]``), before any micro-batch is touched: N and S of
    the whole mini-batch (:func:`mini_batch_norm_stats`) with C = ``cfg.loss_scale_factor``, and, when ``model``
    has experts and a load-balancing or z-loss, the whole mini-batch's expert fractions ``f`` and routed pairs
    ``R`` (a forward pass over the micro-batches); in the legacy mode, only :func:`legacy_share_divisor`."""
    legacy = cfg.normalization == "per_micro_batch"
    loss_scale_factor = float(cfg.loss_scale_factor)
    whole = None if legacy else mini_batch_norm_stats(batch.slots.response_mask, loss_scale_factor, mesh)
    divisor = legacy_share_divisor(cfg, batch) if legacy else None
    balancing = bool(router_aux_coef(cfg, model.config) or router_z_coef(cfg, model.config))
    if balancing and not legacy:
        fractions, pairs = mini_batch_expert_fractions(model, batch, replay=not isinstance(cfg, CriticConfig))
        whole = whole.replace(expert_fractions=fractions, routed_pairs=pairs)
    return MiniBatchNorm(whole, divisor, loss_scale_factor)


def mini_batch_norm_stats(response_mask: jax.Array, loss_scale_factor: float, mesh: Mesh) -> NormStats:
    """Whole-mini-batch N and S: each shard counts its own ``[K, 1, S, L / sequence]`` block, ``psum`` over the
    batch axes (a row's tokens summed over the sequence axis before the row is counted); C is the update's
    ``loss_scale_factor`` (:func:`mini_batch_norm` passes its config's). A response width the sequence axis
    does not divide stays whole on every shard of that axis, counted once."""
    split = sequence_shards(mesh.shape) > 1 and response_mask.shape[-1] % sequence_shards(mesh.shape) == 0
    tokens = SEQUENCE_AXIS if split else None
    axes = BATCH_AXES if split else ROW_AXES

    def local_then_psum(mask):
        return global_norm_stats(mask.reshape(-1, mask.shape[-1]), loss_scale_factor, axis_name=axes, token_axis=tokens)

    return jax.shard_map(
        local_then_psum, mesh=mesh, in_specs=PartitionSpec(None, ROW_AXES, None, tokens), out_specs=PartitionSpec()
    )(response_mask)


def legacy_share_divisor(cfg: UpdateConfig, batch: Batch) -> jax.Array:
    """What each micro-batch's self-normalized loss is divided by in the legacy mode, per role.

    verl's older data-parallel actor divided every micro-batch loss by the number of micro-batches of the
    mini-batch (gradient accumulation as a mean of micro-batch means); its critic, before PR #6957, did not (the
    micro-batch losses were summed: K-fold). The number of micro-batches counts those holding any sequence:
    empty micro-batches that only pad K to a common size are not counted.
    """
    if not isinstance(cfg, ActorConfig):
        return jnp.ones((), jnp.float32)
    segments = batch.segment_ids
    holds_tokens = jnp.any(segments.reshape(segments.shape[0], -1) > 0, axis=1)
    return jnp.maximum(jnp.sum(holds_tokens), 1).astype(jnp.float32)


# 2. each micro-batch: the gradient of its share, into the optimizer


def micro_batch_gradient(
    share_gradient_of: Callable[[nnx.State, Batch], tuple[Grads, Metrics]], params: nnx.State, micro: Batch,
    shapes: Any, routes: bool,
) -> tuple[Grads, Metrics]:
    """``share_gradient_of(params, micro)`` (:func:`share_gradient`), or zeros of its ``shapes`` without running the
    model when ``micro`` holds no response token (with experts, ``routes``: no token at all), where its share and
    gradient are exactly zero anyway: the micro-batches that pad K to a common size cost nothing."""
    holds = jnp.any(micro.slots.response_mask)
    holds = holds | jnp.any(micro.segment_ids != 0) if routes else holds
    return jax.lax.cond(holds, share_gradient_of, lambda p, m: _zeros(shapes), params, micro)


def share_gradient(
    params: nnx.State, micro: Batch, *, frozen: Optional[nnx.State], graphdef: nnx.GraphDef, loss: LossFn,
    norm: MiniBatchNorm,
) -> tuple[Grads, Metrics]:
    """``(d share / d params, metrics)`` of :func:`micro_batch_share`: the gradient with respect to the trained
    ``params`` only (``frozen`` parameters are read as constants)."""
    share_and_metrics = functools.partial(micro_batch_share, frozen=frozen, graphdef=graphdef, loss=loss, norm=norm)
    (_, metrics), grads = jax.value_and_grad(share_and_metrics, has_aux=True)(params, micro)
    return grads, metrics


def micro_batch_share(
    params: nnx.State, micro: Batch, *, frozen: Optional[nnx.State], graphdef: nnx.GraphDef, loss: LossFn,
    norm: MiniBatchNorm,
) -> tuple[jax.Array, Metrics]:
    """One micro-batch's share of the mini-batch loss, and its metric pairs: ``loss`` (a role's objective,
    :mod:`jppo.engine.objectives`) of the model under the whole mini-batch's NormStats, e.g. for ``token-mean``
    ``sum_{t in micro} l_t / N``, so the shares of all micro-batches and shards sum to the whole loss. Legacy
    mode: ``loss`` under the micro-batch's own counts (N_k and S_k over all shards), divided by ``norm.divisor``."""
    if norm.whole is not None:
        return loss(trained_model(graphdef, params, frozen), micro, norm.whole)
    own = global_norm_stats(flatten_shards(micro.slots.response_mask), norm.loss_scale_factor)
    share, metrics = loss(trained_model(graphdef, params, frozen), micro, own)
    return share / norm.divisor.astype(share.dtype), metrics


def trained_model(graphdef: nnx.GraphDef, params: nnx.State, frozen: Optional[nnx.State] = None) -> nnx.Module:
    """The model of the trained ``params``, with the ``frozen`` ones (LoRA's base weights; None: everything trains)
    merged in: differentiated with respect to ``params``, the frozen parameters enter as constants and no gradient
    flows to them."""
    return nnx.merge(graphdef, params) if frozen is None else nnx.merge(graphdef, frozen, params)


# 3. the step's metrics


def step_metrics(
    total: Metrics, report: dict[str, Any], schedule: optax.Schedule, optimizer_step: jax.Array, role: str
) -> dict[str, jax.Array]:
    """The step's metrics: each pair summed over the micro-batches divided once (:func:`jppo.core.metrics.finish`),
    the norm of the accumulated gradient, the learning rate the step was given (``schedule`` at the counter of
    optimizer steps before it, where :func:`~jppo.engine.optim.apply_accumulated` evaluates it) and whether the
    step was skipped as non-finite."""
    values = metrics_lib.finish(total)
    values[f"{role}/grad_norm"] = report["grad_norm"]
    values[f"{role}/lr"] = jnp.asarray(schedule(optimizer_step), jnp.float32)
    values[f"{role}/skipped_updates"] = report["skipped"].astype(jnp.float32)
    return values


def warn_legacy_normalization(cfg: UpdateConfig, role: str) -> None:
    """A warning that ``role``'s gradients depend on the micro-batch split, when its config asks for verl's old
    per-micro-batch normalization."""
    if cfg.normalization != "per_micro_batch":
        return
    how = ("each micro-batch loss is divided by the number of micro-batches (verl's older actor: a mean of "
           "micro-batch means)" if isinstance(cfg, ActorConfig) else
           "the micro-batch losses are summed (verl's critic before PR #6957: K micro-batches give up to K "
           "times the gradient)")
    log.warning(
        "%s.normalization=per_micro_batch: each micro-batch is normalized by its own token counts and %s; "
        "gradients then depend on the micro-batch split (legacy behaviour, for comparison with old curves only)",
        role, how,
    )


def _zeros(tree):
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)
