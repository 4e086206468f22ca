"""A role's train state: its trained parameters, optimizer state and step, made on the devices
(:func:`init_train_state`) or described without a buffer (:func:`abstract_train_state`, what compiling for another
machine needs)."""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jppo.engine.config import UpdateConfig, fixed_micro_batch_count
from jppo.engine.optim import accumulating_optimizer, accumulator_dtype, opt_state_shardings, without_accumulator
from jppo.parallel.hostlocal import placed
from jppo.parallel.mesh import batch_shards


@struct.dataclass
class TrainState:
    """Trained parameters and their optimizer state; ``step`` counts applied (not skipped) optimizer steps (the
    learning-rate schedule counts every optimizer step: ``opt_state.gradient_step``, see :mod:`jppo.engine.optim`).
    ``frozen``: parameters the model reads but never trains (the base weights under LoRA adapters, whose ``params``
    are then the adapters alone), None when everything trains; they get no gradient, moment or accumulator."""

    params: nnx.State
    opt_state: optax.MultiStepsState
    step: jax.Array
    frozen: Optional[nnx.State] = None

    @property
    def weights(self) -> nnx.State:
        """Every parameter of the model (frozen and trained), for forward passes: ``nnx.merge(graphdef, weights)``.
        No array is copied."""
        return self.params if self.frozen is None else nnx.merge_state(self.frozen, self.params)


def _optimizer_init(
    params: nnx.State, cfg: UpdateConfig, mesh: Mesh, keep_gradient: bool
) -> tuple[Callable, object]:
    """``(init, shardings)``: the optimizer state's initialiser of ``params`` and the sharding of each of its leaves
    (moments and accumulator like their parameter, counters replicated), without the accumulator when every
    optimizer step of ``cfg`` on ``mesh`` is one micro-batch or ``cfg.bitwise``."""
    dtype = accumulator_dtype(params)
    tx = accumulating_optimizer(cfg.optim, 1, dtype, keep_gradient)
    replicated = NamedSharding(mesh, PartitionSpec())
    init = lambda p: tx.init(jax.tree.map(lambda x: x.astype(dtype), p))  # noqa: E731
    shardings = opt_state_shardings(tx, init, params, replicated)
    # every step one micro-batch, or the bitwise step's own tree (jppo.engine.bitwise): nothing to accumulate
    if fixed_micro_batch_count(cfg, batch_shards(mesh)) == 1 or cfg.bitwise:
        full, shardings = init, without_accumulator(shardings)
        init = lambda p: without_accumulator(full(p))  # noqa: E731 (the accumulator's zeros are never made)
    return init, shardings


def init_train_state(
    params: nnx.State, cfg: UpdateConfig, mesh: Mesh, keep_gradient: bool = False, frozen: Optional[nnx.State] = None
) -> TrainState:
    """Optimizer state laid out like the (trained) parameters; its scalars (step counters) replicated over ``mesh``.
    ``keep_gradient``: the state has room for the last accumulated gradient (for an update step that returns it).
    ``frozen``: parameters that are read but not trained (kept as they are, see :class:`TrainState`). When every
    optimizer step of ``cfg`` on ``mesh`` is one micro-batch, the state has no gradient accumulator
    (:func:`~jppo.engine.optim.without_accumulator`).

    The optimizer works in the accumulator's dtype (float32 at least): it receives the summed gradient in it, and
    its moments are kept in it, also for bfloat16 parameters (whose updates are rounded only when applied)."""
    init, shardings = _optimizer_init(params, cfg, mesh, keep_gradient)
    replicated = NamedSharding(mesh, PartitionSpec())
    opt_state = jax.jit(init, out_shardings=shardings)(params)
    state = TrainState(params=params, opt_state=opt_state, step=jnp.zeros((), jnp.int32))

    def on_mesh(x: jax.Array) -> jax.Array:
        # jit propagates the parameters' shardings to moments and accumulators; leaves computed from nothing
        # (counters) land on one device and would pin the update to it.
        sharding = x.sharding
        if isinstance(sharding, NamedSharding) and sharding.mesh == mesh:
            return x
        return placed(x, replicated)

    return jax.tree.map(on_mesh, state).replace(frozen=frozen)


def abstract_train_state(
    params: nnx.State, cfg: UpdateConfig, mesh: Mesh, keep_gradient: bool = False, frozen: Optional[nnx.State] = None
) -> TrainState:
    """What :func:`init_train_state` makes, as ``jax.ShapeDtypeStruct`` leaves carrying their shardings, from
    ``params`` given the same way: nothing is computed or allocated, so a program over the state can be lowered
    for devices this machine does not have (:meth:`jppo.engine.update.UpdateStep.lower`)."""
    init, shardings = _optimizer_init(params, cfg, mesh, keep_gradient)
    opt_state = jax.tree.map(
        lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
        jax.eval_shape(init, params), shardings,
    )
    step = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec()))
    return TrainState(params=params, opt_state=opt_state, step=step, frozen=frozen)
