"""One optimizer step of the actor or the critic, as one jitted pure function of (state, micro-batches).

Inside the step:

1. the whole mini-batch's :class:`~jppo.core.masked.NormStats` are computed ONCE, by ``psum`` of shard-local counts over
   the batch axes in a ``shard_map`` region (:func:`mini_batch_norm_stats`), before any micro-batch is touched;
   for a model with experts and a load-balancing loss, also the whole mini-batch's expert fractions, by a forward
   pass over its micro-batches (:func:`jppo.engine.experts.mini_batch_expert_fractions`);
2. ``lax.scan`` runs the K micro-batches: each differentiates its share of the whole loss (every term through
   ``agg_loss`` with those same NormStats) and adds the gradient to the accumulator of
   ``optax.MultiSteps(use_grad_mean=False)``'s state; the K-th runs the optimizer once, on the whole mini-batch
   gradient (:func:`~jppo.engine.optim.apply_accumulated`), and the first K - 1 skip the optimizer's work entirely;
3. metrics are :class:`~jppo.core.metrics.Metric` pairs summed over the scan (and, being sums over global arrays,
   over shards), divided once at the end.

Micro-batches without a single response token (padding to a common K) skip the forward and backward pass: their
share and gradient are exactly zero anyway (with experts, those without a single token: every token is routed).

``normalization="per_micro_batch"`` reproduces, on purpose and per role, what verl computed before it normalized
globally: each micro-batch normalized by its own counts (N and S over all shards; C as configured), the critic's
shares summed, the actor's averaged (:func:`legacy_share_divisor`); loss metrics are means of micro-batch values.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from jppo.core import metrics as metrics_lib
from jppo.engine.config import ActorConfig, UpdateConfig, require_engine_config
from jppo.engine.layout import flatten_shards
from jppo.engine.objectives import Batch, LossFn
from jppo.engine.optim import (
    apply_accumulated, inner_optimizer, learning_rate_schedule, step_report, accumulator_dtype, with_accumulator,
    without_accumulator,
)
from jppo.engine.state import TrainState  # noqa: F401 (its home until it moved: jppo.engine.update.TrainState)
from jppo.core.masked import NormStats, global_norm_stats
from jppo.parallel.mesh import BATCH_AXES, ROW_AXES, SEQUENCE_AXIS, sequence_shards
from jppo.engine.experts import mini_batch_expert_fractions, router_aux_coef, router_z_coef

log = logging.getLogger(__name__)


def mini_batch_norm_stats(response_mask: jax.Array, loss_scale_factor: float, mesh: Mesh) -> NormStats:
    """Whole-mini-batch N and S: each shard counts its own ``[K, 1, S, L / sequence]`` block, ``psum`` over the
    batch axes (a row's tokens summed over the sequence axis before the row is counted); C is the update's
    ``loss_scale_factor`` (:func:`micro_batch_gradient` passes its config's). A response width the sequence axis
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


def micro_batch_gradient(
    graphdef: nnx.GraphDef, loss: LossFn, cfg: UpdateConfig, mesh: Mesh
) -> Callable[[nnx.State, Batch], Callable[[nnx.State, Batch], tuple[nnx.State, dict[str, metrics_lib.Metric]]]]:
    """``prepare(params, micro_batches, frozen=None) -> differentiate``, where ``differentiate(params, micro)`` is the
    gradient (w.r.t. ``params`` only; ``frozen`` parameters are read as constants) of one micro-batch's share of the
    mini-batch loss, with its metric pairs. C is ``cfg.loss_scale_factor``.

    ``prepare`` computes the whole mini-batch's NormStats once (psum over the batch axes), before any
    micro-batch is touched; every ``differentiate`` call then normalizes by them. A micro-batch without a single
    response token skips the model: its share and gradient are exactly zero anyway. In the legacy mode each
    micro-batch is normalized by its own counts instead (N and S of the micro-batch over all shards, C as
    configured), divided by :func:`legacy_share_divisor`.
    """
    require_engine_config(cfg, for_update=True)
    loss_scale_factor = float(cfg.loss_scale_factor)
    legacy = cfg.normalization == "per_micro_batch"

    def prepare(params: nnx.State, batch: Batch, frozen: Optional[nnx.State] = None):
        def model_of(params):  # the frozen parameters enter as constants: no gradient flows to them
            return nnx.merge(graphdef, params) if frozen is None else nnx.merge(graphdef, frozen, params)

        whole = None if legacy else mini_batch_norm_stats(batch.slots.response_mask, loss_scale_factor, mesh)
        divisor = legacy_share_divisor(cfg, batch) if legacy else None
        # a load-balancing loss: the expert fractions of the whole mini-batch; and with experts every micro-batch
        # holding a token (not only a response token) routes it, for its share and the expert load
        model_config = model_of(params).config
        balancing = bool(router_aux_coef(cfg, model_config) or router_z_coef(cfg, model_config))
        routes = isinstance(cfg, ActorConfig) and bool(model_config.sparse_layers)
        if balancing and not legacy:
            fractions, pairs = mini_batch_expert_fractions(model_of(params), batch)
            whole = whole.replace(expert_fractions=fractions, routed_pairs=pairs)

        def share_and_metrics(params, micro):
            if not legacy:
                return loss(model_of(params), micro, whole)
            own = global_norm_stats(flatten_shards(micro.slots.response_mask), loss_scale_factor)
            share, metrics = loss(model_of(params), micro, own)
            return share / divisor.astype(share.dtype), metrics

        grad_fn = jax.value_and_grad(share_and_metrics, has_aux=True)

        def compute(params, micro):
            (_, metrics), grads = grad_fn(params, micro)
            return grads, metrics

        first = jax.tree.map(lambda x: x[0], batch)
        shapes = jax.eval_shape(compute, params, first)

        def differentiate(params, micro):
            holds = jnp.any(micro.slots.response_mask)
            holds = holds | jnp.any(micro.segment_ids != 0) if routes else holds
            return jax.lax.cond(holds, compute, lambda p, m: _zeros(shapes), params, micro)

        return differentiate

    return prepare


def _zeros(tree):
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)


def make_update_step(
    graphdef: nnx.GraphDef, loss: LossFn, cfg: UpdateConfig, mesh: Mesh, role: str, keep_gradient: bool = False
) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array], Any]]:
    """A pure ``(state, micro_batches) -> (state, metrics, gradient)`` for one mini-batch (C: ``cfg``'s) of
    ``role`` (``actor``/``critic``, the prefix of its metric names).

    ``micro_batches`` holds ``[K, D, ...]`` arrays (see :mod:`jppo.engine.microbatch`); K is read from their shape. Each
    micro-batch's gradient goes to ``optax.MultiSteps(every_k_schedule=K, use_grad_mean=False)``, which sums them
    and applies the optimizer once, on the K-th. ``gradient`` is the accumulated gradient the optimizer received,
    as recorded by the optimizer itself (``keep_gradient``, with a state from ``init_train_state(...,
    keep_gradient=True)``), else None.
    """
    prepare = micro_batch_gradient(graphdef, loss, cfg, mesh)
    schedule = learning_rate_schedule(cfg.optim, cfg.optimizer_steps_per_training_step)

    def step(state: TrainState, batch: Batch):
        k = batch.slots.response_mask.shape[0]
        inner = inner_optimizer(cfg.optim, keep_gradient, cfg.optimizer_steps_per_training_step)
        differentiate = prepare(state.params, batch, state.frozen)
        metrics_shape = jax.eval_shape(differentiate, state.params, jax.tree.map(lambda x: x[0], batch))[1]
        dtype, held = accumulator_dtype(state.params), state.opt_state.acc_grads is not None
        # a state without an accumulator given K > 1 micro-batches accumulates in a temporary
        opt_state = state.opt_state if held or k == 1 else with_accumulator(state.opt_state, state.params, dtype)

        def micro_step(carry, micro):
            params, opt_state, total = carry
            grads, metrics = differentiate(params, micro)
            # in the accumulator's dtype (float32 at least), so the summed gradient reaches the optimizer unrounded
            grads = jax.tree.map(lambda g: g.astype(dtype), grads)
            if opt_state.acc_grads is None:  # K = 1 and nothing accumulated: this is the optimizer step
                params, opt_state = apply_last(params, opt_state, grads)
            else:
                params, opt_state = jax.lax.cond(
                    opt_state.mini_step == k - 1, apply_last, accumulate, params, opt_state, grads
                )
            return (params, opt_state, metrics_lib.combine(total, metrics)), None

        def accumulate(params, opt_state, grads):
            # Micro-steps 1 .. K-1 only add to MultiSteps' accumulator. MultiSteps.update would also run the whole
            # inner optimizer on every one of them and keep its result only on the K-th.
            acc_grads = jax.tree.map(jnp.add, opt_state.acc_grads, grads)
            return params, opt_state._replace(acc_grads=acc_grads, mini_step=opt_state.mini_step + 1)

        def apply_last(params, opt_state, grads):
            return apply_accumulated(inner, grads, opt_state, params)

        (params, opt_state, total), _ = jax.lax.scan(
            micro_step, (state.params, opt_state, _zeros(metrics_shape)), batch
        )
        opt_state = opt_state if held else without_accumulator(opt_state)
        report = step_report(opt_state)
        applied = jnp.logical_not(report["skipped"])
        values = metrics_lib.finish(total)
        values[f"{role}/grad_norm"] = report["grad_norm"]
        # the rate this step was given (apply_accumulated evaluates the schedule at the same counter)
        values[f"{role}/lr"] = jnp.asarray(schedule(state.opt_state.gradient_step), jnp.float32)
        values[f"{role}/skipped_updates"] = report["skipped"].astype(jnp.float32)
        new_state = TrainState(
            params=params, opt_state=opt_state, step=state.step + applied.astype(jnp.int32), frozen=state.frozen
        )
        return new_state, values, report["gradient"]

    return step


class UpdateStep:
    """The jitted update: ``(state, steps) -> (state, metrics, gradients)`` for M optimizer steps in one call.

    ``steps`` holds ``[M, K, D, ...]`` arrays (:func:`jppo.engine.microbatch.stack_micro_batches`); ``lax.scan`` runs the
    M mini-batches one after another, so a whole ``ppo_epochs`` x mini-batches update is one dispatch, and the
    compiled program does not depend on M beyond its loop count. State buffers are donated and come back laid out
    exactly as they went in (frozen parameters are an input that is not donated: they come back as the same
    arrays, so a reference policy may read them); metrics come back per step, ``[M]``. ``gradients``: with ``keep_gradient`` (and a
    state made with ``init_train_state(..., keep_gradient=True)``) the accumulated gradient of each optimizer step,
    stacked ``[M, ...]`` (what ``jppo.audit`` and the tests compare); otherwise None.
    """

    def __init__(
        self, graphdef: nnx.GraphDef, loss: LossFn, cfg: UpdateConfig, mesh: Mesh, role: str,
        keep_gradient: bool = False,
    ):
        if cfg.normalization == "per_micro_batch":
            how = ("each micro-batch loss is divided by the number of micro-batches (verl's older actor: a mean of "
                   "micro-batch means)" if isinstance(cfg, ActorConfig) else
                   "the micro-batch losses are summed (verl's critic before PR #6957: K micro-batches give up to K "
                   "times the gradient)")
            log.warning(
                "%s.normalization=per_micro_batch: each micro-batch is normalized by its own token counts and %s; "
                "gradients then depend on the micro-batch split (legacy behaviour, for comparison with old curves only)",
                role, how,
            )
        one_step = make_update_step(graphdef, loss, cfg, mesh, role, keep_gradient)

        def steps(state: TrainState, frozen: Optional[nnx.State], batches: Batch):
            def body(carry, batch):
                carry, metrics, gradient = one_step(carry.replace(frozen=frozen), batch)
                return carry.replace(frozen=None), (metrics, gradient)

            state, (metrics, gradients) = jax.lax.scan(body, state, batches)
            return state, metrics, gradients

        self._steps = steps
        self._mesh = mesh
        self._jitted: Any = None

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
