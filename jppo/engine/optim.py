"""The optimizer of an update step: ``MultiSteps`` accumulation around clipping, a non-finite guard and AdamW.

``optax.MultiSteps(inner, every_k_schedule=K, use_grad_mean=False)`` receives the gradient of each micro-batch's
*share* of the mini-batch loss. The shares sum to the whole loss, so their gradients are summed (the optax default,
``use_grad_mean=True``, would divide the step by K). Only on the K-th micro-step does ``inner`` run for real, on
the accumulated gradient, which is therefore what the gradient-norm metric, clipping and the non-finite check see:

    inner = chain(record_gradient, skip_if_not_finite(chain(clip_by_global_norm, adamw(schedule))))

A mini-batch whose accumulated gradient holds NaN or Inf is skipped by :func:`skip_if_not_finite`: zero updates, the
AdamW state kept as it was, the skip counted in its state (optax's ``ApplyIfFiniteState``).

The learning rate is NOT read from a counter inside ``inner`` (optax's own ``count`` stops on a skipped step, which
would shift every later training step's rates): :func:`scale_by_schedule_at` evaluates the schedule at the
optimizer step ``MultiStepsState.gradient_step``, which :func:`apply_accumulated` advances on every optimizer step,
applied or skipped, and passes in. It is part of the optimizer state, so a checkpoint carries it, and the state's
layout is optax's ``adamw``/``sgd`` one (checkpoints written before this change restore as they are; their
``gradient_step`` already counted every optimizer step).

No accumulator when K = 1: a role whose every optimizer step is one micro-batch (fixed-size micro-batches of the
whole per-shard mini-batch, :func:`jppo.engine.config.fixed_micro_batch_count`) keeps its ``MultiStepsState`` with
``acc_grads=None`` (:func:`without_accumulator`): the accumulator would only ever hold zeros, and costs one float32
copy of the trained parameters. The gradient of the one micro-batch goes to ``inner`` as it is.

Memory: optax's ``apply_if_finite`` and ``MultiSteps.update`` compute the new state and then pick it or the old one
with ``where``, so both are alive at once; XLA's ``memory_analysis()`` of a Qwen2-shaped update put the
temporaries of applying the gradient at 6 float32 copies of the parameters (7 with K = 2). Here the finite check is a
``lax.cond`` (the skipped branch computes nothing) and :func:`apply_accumulated` calls the inner optimizer directly
on the K-th micro-step instead of going through ``MultiSteps.update``: 3 copies.

``record_gradient`` keeps the norm of the accumulated gradient in its state (the ``grad_norm`` metric) and, when
asked (``jppo.audit`` and the tests), the accumulated gradient itself: the audit compares exactly what the
optimizer received, through the same compiled step that training runs.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding

from jppo.core.errors import InvalidSetting
from jppo.core.settings import OptimConfig

OPTIMIZERS = ("adamw", "sgd")
LR_SCHEDULES = ("constant", "cosine")


class GradientRecord(NamedTuple):
    grad_norm: jax.Array
    gradient: Any  # the whole gradient when kept, else None (no memory spent in training)


def record_gradient(keep: bool = False) -> optax.GradientTransformation:
    """Passes updates through unchanged and keeps their global norm (and, with ``keep``, the updates themselves)
    in its state."""

    def init(params):
        # at least float32; float64 for float64 parameters (exactness tests)
        dtype = jnp.result_type(jnp.float32, *jax.tree.leaves(params))
        return GradientRecord(jnp.zeros((), dtype), jax.tree.map(jnp.zeros_like, params) if keep else None)

    def update(updates, state, params=None):
        del params
        norm = optax.global_norm(updates).astype(state.grad_norm.dtype)
        return updates, GradientRecord(norm, updates if keep else None)

    return optax.GradientTransformation(init, update)


def skip_if_not_finite(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """``inner`` on finite updates; on updates holding NaN or Inf, zero updates and ``inner``'s state unchanged.

    The state is optax's ``ApplyIfFiniteState`` (consecutive and total non-finite counts, ``last_finite``). Unlike
    ``optax.apply_if_finite`` it never gives up and applies a non-finite update, and the choice is a ``lax.cond``,
    so a step computes one branch and the old and new optimizer states need not coexist. Extra arguments
    (``optimizer_step``) are passed on to ``inner``."""

    def init(params):
        zero = jnp.zeros((), jnp.int32)
        return optax.ApplyIfFiniteState(zero, jnp.array(True), zero, inner.init(params))

    inner = optax.with_extra_args_support(inner)

    def update(updates, state, params=None, **extra_args):
        finite = jnp.all(jnp.asarray([jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(updates)]))

        def apply(updates, inner_state):
            return inner.update(updates, inner_state, params, **extra_args)

        def skip(updates, inner_state):
            return jax.tree.map(jnp.zeros_like, updates), inner_state

        updates, inner_state = jax.lax.cond(finite, apply, skip, updates, state.inner_state)
        not_finite = jnp.logical_not(finite).astype(jnp.int32)
        return updates, optax.ApplyIfFiniteState(
            notfinite_count=(state.notfinite_count + not_finite) * not_finite, last_finite=finite,
            total_notfinite=state.total_notfinite + not_finite, inner_state=inner_state,
        )

    return optax.GradientTransformationExtraArgs(init, update)


def check_optim(cfg: OptimConfig) -> None:
    """:class:`~jppo.core.errors.InvalidSetting` for the first setting the optimizer cannot use as documented (optax
    itself accepts them and quietly diverges or stalls); the trainer's config runs the same check."""
    adam = cfg.name == "adamw"
    rules = {
        "name": (cfg.name in OPTIMIZERS, f"one of {', '.join(OPTIMIZERS)}"),
        "lr_schedule": (cfg.lr_schedule in LR_SCHEDULES, f"one of {', '.join(LR_SCHEDULES)}"),
        "lr": (cfg.lr >= 0, ">= 0"),
        "weight_decay": (cfg.weight_decay >= 0, ">= 0"),
        "beta1": (not adam or 0 <= cfg.beta1 < 1, "in [0, 1)"),
        "beta2": (not adam or 0 <= cfg.beta2 < 1, "in [0, 1)"),
        "eps": (not adam or cfg.eps > 0, "> 0"),
        "warmup_steps": (cfg.warmup_steps >= 0, ">= 0 (0: no warm-up)"),
        "decay_steps": (cfg.decay_steps >= 0, ">= 0 (0: derived from the run's length)"),
        "min_lr_ratio": (0 <= cfg.min_lr_ratio <= 1, "in [0, 1]"),
    }
    for name, (ok, valid) in rules.items():
        if not ok:
            raise InvalidSetting("optim.", name, getattr(cfg, name), valid)


def learning_rate_schedule(cfg: OptimConfig, optimizer_steps_per_training_step: int = 1) -> optax.Schedule:
    """The learning rate of optimizer step ``count`` (0-based, counting every optimizer step the role has taken,
    skipped ones included: see :func:`scale_by_schedule_at`): the schedule of training step
    ``t = count // optimizer_steps_per_training_step``, so it is constant within a training step, as verl's
    scheduler (stepped once per training step, whatever the gradient) is. Over ``t``: a linear warm-up from
    ``lr / warmup_steps`` to ``lr`` at ``t = warmup_steps - 1``, then ``lr`` constant, or a cosine from ``lr`` at
    ``t = warmup_steps`` down to ``min_lr_ratio * lr`` at ``t = warmup_steps + decay_steps``."""
    check_optim(cfg)
    if optimizer_steps_per_training_step < 1:
        raise InvalidSetting("", "optimizer_steps_per_training_step", optimizer_steps_per_training_step, ">= 1")
    if cfg.lr_schedule == "constant":
        after = optax.constant_schedule(cfg.lr)
    else:
        after = optax.cosine_decay_schedule(cfg.lr, max(cfg.decay_steps, 1), alpha=cfg.min_lr_ratio)
    if cfg.warmup_steps <= 0:
        per_training_step = after
    else:
        warmup = optax.linear_schedule(cfg.lr / cfg.warmup_steps, cfg.lr, cfg.warmup_steps - 1)
        per_training_step = optax.join_schedules([warmup, after], [cfg.warmup_steps])
    if optimizer_steps_per_training_step == 1:
        return per_training_step
    return lambda count: per_training_step(count // optimizer_steps_per_training_step)


def scale_by_schedule_at(schedule: optax.Schedule) -> optax.GradientTransformationExtraArgs:
    """Updates times ``-schedule(optimizer_step)``, where ``optimizer_step`` is an argument of ``update``.

    optax's ``scale_by_learning_rate`` reads its own ``count``, which advances only when the step is applied: behind
    :func:`skip_if_not_finite` a skipped step would leave it one behind for the rest of the run, so with M optimizer
    steps per training step every later training step would take its M steps at two rates, and warm-up and decay
    would end late. The caller passes the counter of every optimizer step instead (:func:`apply_accumulated`:
    ``MultiStepsState.gradient_step``, before this step). The state is optax's ``ScaleByScheduleState``, counting
    applied steps as optax does; it is not read, and kept so the optimizer state has optax's own layout."""

    def init(params):
        del params
        return optax.ScaleByScheduleState(count=jnp.zeros((), jnp.int32))

    def update(updates, state, params=None, *, optimizer_step=None, **extra_args):
        del params, extra_args
        if optimizer_step is None:
            raise TypeError("scale_by_schedule_at: update() needs optimizer_step= (every optimizer step so far)")
        rate = schedule(optimizer_step)
        updates = jax.tree.map(lambda u: jnp.asarray(-rate, u.dtype) * u, updates)  # as optax rounds it
        return updates, optax.ScaleByScheduleState(count=optax.safe_increment(state.count))

    return optax.GradientTransformationExtraArgs(init, update)


def inner_optimizer(
    cfg: OptimConfig, keep_gradient: bool = False, optimizer_steps_per_training_step: int = 1
) -> optax.GradientTransformationExtraArgs:
    """What runs once per mini-batch on the accumulated gradient (kept in the state with ``keep_gradient``); its
    learning rate follows :func:`learning_rate_schedule` at the ``optimizer_step`` its ``update`` is given.

    AdamW and SGD are optax's own chains (``adamw``: Adam's moments, decoupled weight decay, the rate; ``sgd``
    without momentum: the rate) with the rate from :func:`scale_by_schedule_at`: the same state layout."""
    schedule = learning_rate_schedule(cfg, optimizer_steps_per_training_step)  # refuses what check_optim refuses
    if cfg.name == "adamw":
        base = optax.chain(
            optax.scale_by_adam(b1=cfg.beta1, b2=cfg.beta2, eps=cfg.eps),
            optax.add_decayed_weights(cfg.weight_decay), scale_by_schedule_at(schedule),
        )
    else:
        base = optax.chain(optax.identity(), scale_by_schedule_at(schedule))
    guarded = optax.chain(optax.clip_by_global_norm(cfg.grad_clip), base) if cfg.grad_clip > 0 else base
    return optax.chain(record_gradient(keep_gradient), skip_if_not_finite(guarded))


def accumulating_optimizer(
    cfg: OptimConfig, num_micro_batches: int, accumulator_dtype=jnp.float32, keep_gradient: bool = False,
    optimizer_steps_per_training_step: int = 1,
) -> optax.MultiSteps:
    """``MultiSteps`` over ``num_micro_batches`` summed micro-batch gradients.

    The state layout does not depend on ``num_micro_batches``, so one state serves every K a run uses (token-budget
    micro-batching may change K between steps). A run whose every step has K = 1 keeps its state without the
    accumulator (:func:`without_accumulator`).
    """
    return optax.MultiSteps(
        inner_optimizer(cfg, keep_gradient, optimizer_steps_per_training_step), every_k_schedule=num_micro_batches,
        use_grad_mean=False, accumulator_dtype=accumulator_dtype,
    )


def without_accumulator(opt_state: optax.MultiStepsState) -> optax.MultiStepsState:
    """``opt_state`` with no gradient accumulator (``acc_grads=None``): what a role whose every optimizer step has
    one micro-batch keeps, saving one float32 copy of its trained parameters. Its counters and inner state are
    ``MultiSteps``' own; an update step given more than one micro-batch accumulates in a temporary instead."""
    return opt_state._replace(acc_grads=None)


def apply_accumulated(
    inner: optax.GradientTransformation, grads: Any, opt_state: optax.MultiStepsState, params: Any
) -> tuple[Any, optax.MultiStepsState]:
    """The K-th micro-step of a ``MultiSteps`` state: ``inner`` on the accumulated gradient plus ``grads`` (``grads``
    alone for a state :func:`without_accumulator`), the parameters updated, the accumulator emptied (zeros, not
    ``0 *`` it, which would keep a NaN) and the micro-step count reset. This is what ``MultiSteps.update`` does on
    its K-th call, without computing the result of the other calls beside it (see the module docstring).

    ``inner`` is given ``optimizer_step=gradient_step`` (the optimizer steps before this one, skipped ones
    included), the counter its learning rate is evaluated at (:func:`scale_by_schedule_at`); ``gradient_step``
    then advances whether or not the step was applied."""
    held = opt_state.acc_grads is not None  # a state without an accumulator (K = 1): the gradient is the total
    total = jax.tree.map(jnp.add, opt_state.acc_grads, grads) if held else grads
    updates, inner_state = inner.update(
        total, opt_state.inner_opt_state, params, optimizer_step=opt_state.gradient_step
    )
    new_state = opt_state._replace(
        mini_step=jnp.zeros_like(opt_state.mini_step), gradient_step=opt_state.gradient_step + 1,
        inner_opt_state=inner_state, acc_grads=jax.tree.map(jnp.zeros_like, total) if held else None,
    )
    return optax.apply_updates(params, updates), new_state


def step_report(opt_state: optax.MultiStepsState) -> dict[str, Any]:
    """Of the last mini-batch: the norm of its accumulated gradient, whether its update was skipped as
    non-finite, and the accumulated gradient itself (None unless the optimizer keeps it)."""
    record, finite_state = opt_state.inner_opt_state
    return {
        "grad_norm": record.grad_norm, "skipped": jnp.logical_not(finite_state.last_finite),
        "gradient": record.gradient,
    }


def opt_state_shardings(
    tx: optax.GradientTransformation, init: Callable, params: Any, replicated: NamedSharding
):
    """Each per-parameter leaf of the optimizer state (moments, accumulator) sharded like its parameter, the
    counters replicated. jit does not carry a parameter's sharding over to ``zeros_like(parameter)`` by itself: the
    moments would come out whole on every device, and FSDP would shard only the parameters."""

    def like(param: jax.Array):
        sharding = getattr(param, "sharding", None)
        return sharding if isinstance(sharding, NamedSharding) and sharding.mesh == replicated.mesh else replicated

    shardings = jax.tree.map(like, params)
    return optax.tree_map_params(
        tx, lambda _, sharding: sharding, jax.eval_shape(init, params), shardings,
        transform_non_params=lambda _: replicated,
    )


def accumulator_dtype(params: Any) -> jnp.dtype:
    """float32 (bf16 gradients would lose the small micro-batch contributions), float64 when the parameters are
    float64 (exactness tests)."""
    widest = max((jnp.dtype(x.dtype) for x in jax.tree.leaves(params)), key=lambda d: d.itemsize)
    return jnp.float64 if widest == jnp.float64 else jnp.float32
