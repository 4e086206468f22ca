"""Logical axis names on parameters and activations, and sharded model creation.

Every parameter is an ``nnx.Param`` whose ``out_sharding`` metadata holds one logical name per dimension (names
of :data:`jppo.parallel.mesh.LOGICAL_RULES`, ``None`` for replicated); ``sharding_rules`` points at the same table, so
flax's own ``nnx.get_partition_spec`` agrees with :func:`partition_specs`. The mapping to mesh axes is made only
by :func:`jppo.parallel.mesh.logical_to_spec`. Parameters are never sharded eagerly at construction: that is
:func:`create_model`'s job, inside one jit with the shardings as outputs.

Activation hints (:func:`constrain`) apply only while a mesh is set with ``jax.set_mesh(mesh)`` at trace time;
without one they are no-ops and jit propagates the shardings of the inputs.

Parameter layout (``[in, out]`` kernels; attention projections flattened over heads, the flattened dimension
carries the heads' logical name, head-major as in Hugging Face checkpoints; ``Ld`` layers with the dense MLP, ``Ls``
with ``X`` experts of width ``G``, :mod:`jppo.models.moe`):

=====================================  ===================  ========================================
parameter                              shape                logical names
=====================================  ===================  ========================================
``decoder.embed_tokens``               ``[V, D]``           ``vocab, embed``
``decoder.layers.q_proj``              ``[L, D, H*E]``      ``layers, embed, q_heads``
``decoder.layers.k_proj`` / ``v_proj`` ``[L, D, K*E]``      ``layers, embed, kv_heads``
``decoder.layers.o_proj``              ``[L, H*E, D]``      ``layers, q_heads, embed``
``decoder.layers.{q,k,v}_bias``        ``[L, H*E | K*E]``   ``layers, q_heads | kv_heads``
``decoder.layers.o_bias``              ``[L, D]``           ``layers, -``
``decoder.layers.{q,k}_norm``          ``[L, E]``           ``layers, head_dim``
``decoder.layers.*_norm`` (D-wide)     ``[L, D]``           ``layers, -``
``decoder.layers.gate_proj``/``up``    ``[Ld, D, F]``       ``layers, embed, mlp``
``decoder.layers.down_proj``           ``[Ld, F, D]``       ``layers, mlp, embed``
``decoder.layers.router``              ``[Ls, D, X]``       ``layers, embed, -``
``decoder.layers.expert_gate``/``up``  ``[Ls, X, D, G]``    ``layers, experts, embed, mlp``
``decoder.layers.expert_down``         ``[Ls, X, G, D]``    ``layers, experts, mlp, embed``
``decoder.norm``                       ``[D]``              ``-``
``lm_head`` (untied only)              ``[D, V]``           ``embed, vocab``
``value_head.kernel`` / ``bias``       ``[D, 1]`` / ``[1]`` ``embed, value`` / ``value``
=====================================  ===================  ========================================
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence, TypeVar

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jppo.models.config import ModelConfig
from jppo.parallel.mesh import BATCH_AXES, EXPERT_AXIS, LOGICAL_RULES, fitted_spec, logical_to_spec

Array = jax.Array
Names = tuple[str | None, ...]
ModelT = TypeVar("ModelT", bound=nnx.Module)

_RULES = tuple(LOGICAL_RULES.items())


def param(value: Array, names: Names) -> nnx.Param:
    """A parameter carrying the logical axis ``names`` of its dimensions."""
    if len(names) != value.ndim:
        raise ValueError(f"logical names {names} do not match a parameter of shape {value.shape}")
    return nnx.Param(value, out_sharding=names, sharding_rules=_RULES, eager_sharding=False)


def logical_names(variable: nnx.Variable) -> Names:
    """The logical names of a parameter's dimensions (all ``None`` when it carries none)."""
    names = variable.get_metadata().get("out_sharding")
    return tuple(names) if names else (None,) * len(variable.shape)


def constrain(x: Array, names: Sequence[str | None]) -> Array:
    """``with_sharding_constraint`` by logical names under the mesh set with ``jax.set_mesh``; else ``x``.
    A dimension that its mesh axes do not divide is left replicated rather than padded. Inside ``shard_map`` the
    axes it made manual are left out: ``x`` is one device's piece along them."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.are_all_axes_manual:
        return x
    return jax.lax.with_sharding_constraint(x, fitted_spec(x.shape, names, dict(mesh.shape), mesh.manual_axes))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def constrain_gradient(x: Array, names: Sequence[str | None]) -> Array:
    """``x`` unchanged; its gradient laid out by the logical ``names`` (:func:`constrain`) where it is made. A layer
    of the scan reads its slice of the stacked weights (split over ``fsdp``) gathered whole; the slice's gradient,
    summed over the rows of every device, then comes back split over ``fsdp`` inside the loop (a reduce-scatter per
    layer), not whole: left to itself XLA:GPU keeps the float32 gradients of all layers whole through the layer
    loop's backward pass and splits them after it (``docs/compiling.md``)."""
    return x


def _constrain_gradient_fwd(x: Array, names: Sequence[str | None]) -> tuple[Array, None]:
    return x, None


def _constrain_gradient_bwd(names: Sequence[str | None], _, gradient: Array) -> tuple[Array]:
    return (constrain(gradient, names),)


constrain_gradient.defvjp(_constrain_gradient_fwd, _constrain_gradient_bwd)


def without_batch_axes(spec: PartitionSpec, names: Sequence[str | None] = ()) -> PartitionSpec:
    """``spec`` with the batch axes (``data``, ``fsdp``, ``expert``, ``sequence``) taken out of every dimension:
    replicated over them; except the ``expert`` axis of a dimension whose logical name (``names``) is ``experts``,
    so that each device keeps its own group of a mixture's experts (the tokens go to them, not they to the
    tokens)."""
    names = tuple(names) + (None,) * (len(spec) - len(names))

    def kept(axes, name):
        keep = (EXPERT_AXIS,) if name == "experts" else ()
        group = tuple(axis for axis in ((axes,) if isinstance(axes, str) else (axes or ()))
                      if axis not in BATCH_AXES or axis in keep)
        return group[0] if len(group) == 1 else (group or None)

    return PartitionSpec(*(kept(axes, name) for axes, name in zip(spec, names)))


def decoding_copy(value: Array, names: Sequence[str | None], dtype=None) -> Array:
    """The sampler's copy of a weight: cast to ``dtype`` (``None``: kept) where its shards are, so that gathering
    it moves ``dtype`` bytes, then laid out for decoding under the mesh set with ``jax.set_mesh``: replicated over
    the batch axes, which split a decoding step's rows (a weight sharded over them would be gathered at every
    step, or, hoisted out of the loop by XLA, held whole in its stored dtype), and split over ``tensor`` as the
    rule table says (a mixture's experts stay split over ``expert``). Without a mesh: the cast only."""
    if dtype is not None and value.dtype != dtype:
        value = constrain(value.astype(dtype), names)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.are_all_axes_manual:
        return value
    spec = fitted_spec(value.shape, names, dict(mesh.shape), mesh.manual_axes)
    return jax.lax.with_sharding_constraint(value, without_batch_axes(spec, names))


def variable_spec(variable: nnx.Variable, mesh: Mesh) -> PartitionSpec:
    """The ``PartitionSpec`` of a parameter on ``mesh``: its logical names through the rule table, with the
    dimensions the mesh does not divide left replicated."""
    return fitted_spec(variable.shape, logical_names(variable), dict(mesh.shape))


def _state(model_or_state: nnx.Module | nnx.State) -> nnx.State:
    return nnx.state(model_or_state) if isinstance(model_or_state, nnx.Module) else model_or_state


def partition_specs(model_or_state: nnx.Module | nnx.State) -> nnx.State:
    """The state's structure with each variable's value replaced by its mesh ``PartitionSpec``."""
    return jax.tree.map(
        lambda variable: variable.replace(logical_to_spec(logical_names(variable))),
        _state(model_or_state),
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )


def param_shardings(model_or_state: nnx.Module | nnx.State, mesh: Mesh) -> nnx.State:
    """The state's structure with each variable's value replaced by its ``NamedSharding`` on ``mesh``: usable as
    jit ``in_shardings``/``out_shardings`` for ``nnx.state(model)``. Dimensions the mesh does not divide stay
    replicated (:func:`jppo.parallel.mesh.fitted_spec`)."""
    return jax.tree.map(
        lambda variable: variable.replace(NamedSharding(mesh, variable_spec(variable, mesh))),
        _state(model_or_state),
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )


def create_model(cls: type[ModelT], config: ModelConfig, mesh: Mesh | None = None, *, seed: int = 0) -> ModelT:
    """``cls(config, rngs=nnx.Rngs(seed))`` initialised inside one jit whose outputs are the parameters'
    shardings on ``mesh``: each device computes only its own shards, and random initialisation is
    sharding-invariant, so the values equal the single-device ones. Without a mesh: on the default device.
    The jitted initialiser is reused across seeds."""
    graphdef, initialise = _initialiser(cls, config, mesh)
    return nnx.merge(graphdef, initialise(jax.random.key(seed)))


@functools.lru_cache(maxsize=8)
def _initialiser(cls: type[ModelT], config: ModelConfig, mesh: Mesh | None) -> tuple[nnx.GraphDef, Callable]:
    build = lambda key: cls(config, rngs=nnx.Rngs(key))  # noqa: E731
    graphdef, abstract_state = nnx.split(nnx.eval_shape(lambda: build(jax.random.key(0))))
    out_shardings = None if mesh is None else param_shardings(abstract_state, mesh)
    return graphdef, jax.jit(lambda key: nnx.state(build(key)), out_shardings=out_shardings)
