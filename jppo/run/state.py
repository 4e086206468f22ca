"""``RunState``: everything a training run must remember between steps, as one pytree.

A checkpoint is this pytree (orbax, each process writing its shards); a resume restores it into the shapes and
shardings of a freshly initialised state, so it lands on any mesh. Every random draw of step ``s`` is a function of
``(rng, s)`` (``jax.random.fold_in``), so a resumed run continues exactly as an uninterrupted one would.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jppo.engine import TrainState
from jppo.engine.optim import accumulator_dtype
from jppo.parallel.hostlocal import placed
from jppo.rewards.kl_penalty import KLControlState


@struct.dataclass
class RunState:
    """Attributes:
        actor: the policy's parameters and optimizer state.
        critic: the value model's, or None without a critic.
        kl: the KL-in-reward controller's coefficient.
        data_position: prompts consumed so far (the data order is a function of the seed and the position).
        step: training steps done (``int(state.step)`` on the host).
        rng: the run's root key, as raw key data (what orbax stores).
        behind: with ``trainer.off_policy_steps`` k >= 1, the k copies of the actor's trained parameters that
            sample the next k batches, oldest first (:mod:`jppo.run.offpolicy`); None at k = 0.
    """

    actor: TrainState
    critic: Optional[TrainState]
    kl: KLControlState
    data_position: jax.Array
    step: jax.Array
    rng: jax.Array
    behind: Optional[tuple] = None

    def key(self, step: int) -> jax.Array:
        """The key of training step ``step``'s draws."""
        return jax.random.fold_in(jax.random.wrap_key_data(self.rng), step)


def init_run_state(
    actor: TrainState, critic: Optional[TrainState], kl: KLControlState, seed: int, mesh: Mesh,
    behind: Optional[tuple] = None,
) -> RunState:
    """Step 0, data position 0; the scalars replicated over ``mesh`` (so a checkpoint restores onto any mesh).
    ``behind``: the off-policy weight queue (:func:`jppo.run.offpolicy.initial_behind`)."""
    replicated = NamedSharding(mesh, PartitionSpec())
    scalars = dict(
        kl=KLControlState(coef=jnp.asarray(kl.coef, jnp.float32)),
        data_position=jnp.zeros((), jnp.int32),
        step=jnp.zeros((), jnp.int32),
        rng=jax.random.key_data(jax.random.key(seed)),
    )
    return RunState(actor=actor, critic=critic, behind=behind, **placed(scalars, replicated))


def advance(state: RunState, **changes) -> RunState:
    """``state`` with some fields replaced; host scalars (ints, floats) become replicated arrays like the ones
    they replace."""

    def like(old: jax.Array, new) -> jax.Array:
        return placed(jnp.asarray(new, old.dtype), old.sharding)

    fixed = {}
    for name, value in changes.items():
        old = getattr(state, name)
        if name == "kl":
            value = KLControlState(coef=like(old.coef, value.coef))
        elif name in ("data_position", "step"):
            value = like(old, value)
        fixed[name] = value
    return state.replace(**fixed)


def checkpointed(state: RunState) -> RunState:
    """What a checkpoint holds: ``state`` without frozen parameters (LoRA's base weights), which a run rebuilds as
    the checkpoint's meta records them (``model.path`` or the seed, :func:`jppo.run.record.model_record`)."""
    return state.replace(
        actor=state.actor.replace(frozen=None),
        critic=None if state.critic is None else state.critic.replace(frozen=None),
    )


def with_frozen(restored: RunState, like: RunState) -> RunState:
    """A restored :func:`checkpointed` state with the frozen parameters of ``like`` (the freshly built state)."""
    return restored.replace(
        actor=restored.actor.replace(frozen=like.actor.frozen),
        critic=None if restored.critic is None else restored.critic.replace(frozen=like.critic.frozen),
    )


def rescheduled(state: RunState, saved: dict, now: dict) -> RunState:
    """``state``, restored from a checkpoint whose roles took ``saved[role]`` optimizer steps per training step
    (``ppo_epochs`` x mini-batches), with each role's optimizer-step count in this run's ``now[role]``.

    The learning rate of optimizer step ``c`` is the schedule's at training step ``c // now``
    (:func:`jppo.engine.optim.learning_rate_schedule`). A checkpoint is written between training steps, so its
    count is ``c = u * saved`` after ``u`` training steps' updates; resumed with another count per step it becomes
    ``c // saved * now``: the schedule goes on from training step ``u``, whatever ``ppo_epochs`` is now."""
    roles = {}
    for role, after in now.items():
        train, before = getattr(state, role), saved.get(role, after)
        if train is None or before == after:
            continue
        count = train.opt_state.gradient_step
        roles[role] = train.replace(opt_state=train.opt_state._replace(gradient_step=count // before * after))
    return state.replace(**roles)


def saved_layout(target: RunState, saved: dict) -> RunState:
    """The restore target of a checkpoint whose state has the structure ``saved``
    (:func:`jppo.run.checkpoint.saved_tree`): ``target`` with each role's gradient accumulator as the checkpoint
    holds it. A role whose every optimizer step is one micro-batch keeps no accumulator (``acc_grads=None``), so
    a checkpoint written before that, or on a mesh with another K, may hold one where ``target`` has none (read
    as shapes, then dropped by :func:`fitted_accumulators`) or none where ``target`` has one. Between optimizer
    steps an accumulator holds zeros, so neither loses anything."""
    roles = {}
    for role in ("actor", "critic"):
        train = getattr(target, role)
        if train is None or not isinstance(saved.get(role), dict):
            continue
        held = saved[role].get("opt_state", {}).get("acc_grads") is not None
        if held == (train.opt_state.acc_grads is not None):
            continue
        dtype = accumulator_dtype(train.params)
        shapes = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, dtype, sharding=p.sharding), train.params)
        roles[role] = train.replace(opt_state=train.opt_state._replace(acc_grads=shapes if held else None))
    return target.replace(**roles)


def saved_fields(target: RunState, saved: dict) -> dict:
    """The restore target of a checkpoint whose state has the structure ``saved``, as a dict of the fields it
    holds: one written before a field existed (``behind``, at k = 0) is read without it, and
    ``RunState(**restored)`` gives the field its default."""
    return {field: getattr(target, field) for field in target.__dataclass_fields__ if field in saved}


def fitted_accumulators(restored: RunState, like: RunState) -> RunState:
    """``restored`` (read into :func:`saved_layout`) with each role's accumulator as ``like`` (the freshly built
    state) has it: none, or ``like``'s own (zeros)."""
    roles = {}
    for role in ("actor", "critic"):
        train, fresh = getattr(restored, role), getattr(like, role)
        if train is not None and (train.opt_state.acc_grads is None) != (fresh.opt_state.acc_grads is None):
            roles[role] = train.replace(opt_state=train.opt_state._replace(acc_grads=fresh.opt_state.acc_grads))
    return restored.replace(**roles)
