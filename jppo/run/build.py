"""What a training run is built from, made from its configuration: vocabulary, data, rewards, models, sampling.

Everything that can fail on user input (a missing file, a bad task option, a checkpoint without a tensor) fails
here, before anything is compiled, with a one-line message.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding

import jppo.run.checks  # noqa: F401 (every component's check of a config, registered before one is loaded)
from jppo.config import ConfigError, TrainConfig
from jppo.config.views import (
    checkpoint_overrides,
    random_model_config,
    reference_param_dtype,
    rollout_engine_spec,
    sampling_config,
    tokenizer_spec,
)
from jppo.core.checks import run_missing_checks
from jppo.core.settings import LoRAConfig
from jppo.data import PromptDataset, Tokenizer, load_dataset, load_tokenizer, task_of
from jppo.data.tasks import Task
from jppo.models import CausalLM, ModelConfig, ValueModel, create_model, load_pretrained, read_config
from jppo.models.layers import is_norm_scale
from jppo.models.lora import attach_lora, load_saved_adapters, saved_adapter_config, trainable_filter
from jppo.rewards import CreditFn, RewardFn, build_credit_fn, build_reward_fn
from jppo.rewards.workers import Guarded
from jppo.rollout import ROLLOUT_ENGINES
from jppo.rollout.env import EnvFactory, load_env, stop_token_ids

log = logging.getLogger("jppo.run.build")


@dataclasses.dataclass
class RunInputs:
    """What a run reads from outside: vocabulary, prompts and the reward function."""

    tokenizer: Tokenizer
    train_data: Optional[PromptDataset]  # None: no training rollouts (an SFT run scoring its held-out prompts)
    val_data: Optional[PromptDataset]
    reward_fn: RewardFn
    credit_fn: Optional[CreditFn] = None
    env_factory: Optional[EnvFactory] = None  # rollout.env: one environment per response
    stop_ids: tuple[int, ...] = ()  # tokens that end a model turn besides EOS (the env's stop texts)


def load_inputs(cfg: TrainConfig, evaluation: bool = False) -> RunInputs:
    """Vocabulary, prompts and rewards of the run; the held-out prompts when the run evaluates on them (or with
    ``evaluation``, for ``python -m jppo.eval``). What they refuse (a missing file, a task option, a prompt over
    ``data.max_prompt_length``, a plug-in that does not load) is a :class:`ConfigError` in one line."""
    try:
        tokenizer = load_tokenizer(tokenizer_spec(cfg))
        train = load_dataset(cfg.data, tokenizer, "train")
        has_val = evaluation or cfg.trainer.val_every > 0 or cfg.trainer.val_before_train
        val = load_dataset(cfg.data, tokenizer, "val") if has_val else None
        task = task_of(cfg.data)
        env = load_env(cfg.rollout.env) if cfg.rollout.env is not None else None
        stop_ids = stop_token_ids(env, tokenizer, cfg.rollout.env) if env is not None else ()
        return RunInputs(tokenizer, train, val, reward_of(cfg, task), build_credit_fn(cfg.reward, task), env, stop_ids)
    except (ValueError, KeyError, FileNotFoundError) as error:
        text = error.args[0] if isinstance(error, KeyError) and error.args else str(error)  # KeyError quotes its text
        raise ConfigError(" ".join(str(text).split())) from None


def reward_of(cfg: TrainConfig, task: Optional[Task]) -> Guarded:
    """The run's reward function (checked by building it here), under ``reward.on_error`` and in
    ``reward.workers`` processes of their own when there are any (:mod:`jppo.rewards.workers`)."""
    spec = None if task is None else (cfg.data.task, dict(cfg.data.task_options))
    return Guarded(build_reward_fn(cfg.reward, task), cfg.reward, spec)


def build_policy(cfg: TrainConfig, tokenizer: Tokenizer, mesh: Mesh, seed: Optional[int] = None) -> CausalLM:
    """``model.path``, or a model drawn from ``seed`` (default ``trainer.seed``; a checkpoint's: its recorded one)."""
    if cfg.model.path:
        return load_pretrained(cfg.model.path, mesh=mesh, **checkpoint_overrides(cfg))
    seed = cfg.trainer.seed if seed is None else seed
    return create_model(CausalLM, random_model_config(cfg, tokenizer), mesh, seed=seed)


def sampling_graphdef(cfg: TrainConfig, policy: CausalLM) -> nnx.GraphDef:
    """The structure the sampler runs the policy's parameters with: the policy's, computing in ``rollout.dtype``
    (same parameters, same layout; only the compute dtype, a static attribute, differs)."""
    config = sampling_config(cfg, policy.config)

    def structure():
        model = type(policy)(config, rngs=nnx.Rngs(0))
        return attach_lora(model, cfg.actor.lora, 0) if has_adapters(policy) else model  # the adapters too

    return nnx.split(nnx.eval_shape(structure), nnx.Param)[0]


def rollout_engine(cfg: TrainConfig, policy: CausalLM):
    """``rollout.engine`` started for ``policy`` (:data:`jppo.rollout.ROLLOUT_ENGINES`); what it cannot run (vLLM
    missing, a model it cannot load) is a one-line :class:`ConfigError`, before anything is compiled."""
    return ROLLOUT_ENGINES.lookup(cfg.rollout.engine)(rollout_engine_spec(cfg, policy))


def build_critic(cfg: TrainConfig, policy: CausalLM, mesh: Mesh, seed: Optional[int] = None) -> ValueModel:
    """The critic starts from the policy's backbone with a new value head (or from ``critic.model_path``), the
    head drawn from ``seed + 1`` (``seed`` as :func:`build_policy`'s)."""
    path = cfg.critic.model_path or cfg.model.path
    seed = cfg.trainer.seed if seed is None else seed
    if path:
        return load_pretrained(path, head="value", mesh=mesh, seed=seed + 1, **checkpoint_overrides(cfg))
    return ValueModel.from_policy(policy, rngs=nnx.Rngs(seed + 1))


def build_reference(cfg: TrainConfig, policy: CausalLM, mesh: Mesh) -> Optional[nnx.State]:
    """Parameters of the reference policy: ``ref.model_path``, or a copy of the policy's initial weights, kept in
    ``ref.param_dtype`` (:func:`kept_in`). A policy with LoRA adapters needs no copy: its reference is its own
    frozen base weights, read in place (None here)."""
    dtype = reference_param_dtype(cfg)
    if cfg.ref.model_path:
        model = load_pretrained(cfg.ref.model_path, mesh=mesh, **checkpoint_overrides(cfg))
        return kept_in(nnx.state(model, nnx.Param), dtype, copy=False)
    if has_adapters(policy):
        return None
    return kept_in(nnx.state(policy, nnx.Param), dtype, copy=True)  # a copy: the policy's arrays are donated


def kept_in(params: nnx.State, dtype: str, copy: bool) -> nnx.State:
    """``params`` with every weight the model reads in the compute dtype (kernels, embeddings, biases) cast to
    ``dtype``; the norm scales (read in float32, :func:`jppo.models.layers.is_norm_scale`) as they are. A forward
    pass in a compute dtype of ``dtype`` then gives bit for bit what it gives on ``params``: the cast is the one it
    would make. ``copy``: arrays left as they are are copied too (none is shared with ``params``)."""

    def keep(path, x: jax.Array) -> jax.Array:
        name = next(key.key for key in reversed(path) if isinstance(key, jax.tree_util.DictKey))
        if is_norm_scale(name) or x.dtype == jnp.dtype(dtype):
            return jnp.copy(x) if copy else x
        return x.astype(dtype)

    return jax.tree_util.tree_map_with_path(keep, params)


def has_adapters(model: nnx.Module) -> bool:
    return model.decoder.layers.lora is not None


def add_adapters(model: nnx.Module, lora: LoRAConfig, seed: int) -> Optional[nnx.GraphDef]:
    """Attaches ``lora``'s adapters to ``model`` when enabled; returns the structure of the model without them
    (what reads the base weights alone: the reference policy, the merged export), or None without LoRA."""
    if not lora.enabled:
        return None
    base = nnx.graphdef(model)
    attach_lora(model, lora, seed)
    return base


def split_trained(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State, Optional[nnx.State]]:
    """``(graphdef, trained, frozen)``: every parameter trains (frozen None), or, with adapters, only the adapters
    (and a critic's value head) while the base weights are frozen."""
    if not has_adapters(model):
        graphdef, params = nnx.split(model, nnx.Param)
        return graphdef, params, None
    return nnx.split(model, trainable_filter(model), nnx.Param)


ROLES = ("actor", "critic")


# Seeds drawn from for a run's models, as offsets of its seed: the policy's random weights 0, the critic's value
# head 1 (build_critic), the actor's LoRA adapters 2, the critic's 3.
ADAPTER_SEED_OFFSETS = {"actor": 2, "critic": 3}


@dataclasses.dataclass
class Trained:
    """One role's model split as its update trains it (:func:`split_trained`): ``params`` train, ``frozen`` is
    LoRA's base (None without adapters)."""

    graphdef: nnx.GraphDef
    params: nnx.State
    frozen: Optional[nnx.State]


@dataclasses.dataclass
class Models:
    """A run's models as :func:`models` builds them. ``policy``: the policy module (adapters attached), whose
    parameters ``actor`` holds; ``base``: its structure without adapters (None without LoRA); ``critic`` None when
    not built; ``reference``: the KL reference's parameters (None: none built, or LoRA's frozen base in place)."""

    policy: CausalLM
    actor: Trained
    base: Optional[nnx.GraphDef]
    critic: Optional[Trained]
    reference: Optional[nnx.State]


def models(
    cfg: TrainConfig, tokenizer: Tokenizer, mesh: Optional[Mesh], seed: Optional[int] = None, *,
    roles: Sequence[str] = ROLES, reference: bool = True,
) -> Models:
    """The run's models, built the one way every command builds them (training, evaluation, audit, export), so a
    checkpoint's arrays fit them: the policy, the critic when the config trains one and ``roles`` has it (from the
    policy's backbone, before the policy's adapters), each role's adapters, and the KL reference when the config
    uses one and ``reference``. ``seed``: what the random weights are drawn from (default ``trainer.seed``; a
    checkpoint's models: the seed it records), with the offsets :data:`ADAPTER_SEED_OFFSETS`."""
    run_missing_checks(cfg)  # a config loaded before the components' checks were: theirs, before anything compiles
    seed = cfg.trainer.seed if seed is None else seed
    policy = build_policy(cfg, tokenizer, mesh, seed)
    critic_model = build_critic(cfg, policy, mesh, seed) if cfg.use_critic and "critic" in roles else None
    base = add_adapters(policy, cfg.actor.lora, seed + ADAPTER_SEED_OFFSETS["actor"])
    if cfg.model.path and saved_adapter_config(cfg.model.path) is not None:  # an export that kept its adapters
        load_saved_adapters(policy, cfg.model.path)  # trained on from there (their match: the config's check)
    actor = Trained(*split_trained(policy))
    ref_params = build_reference(cfg, policy, mesh) if cfg.use_reference and reference else None
    critic = None
    if critic_model is not None:
        add_adapters(critic_model, cfg.critic.lora, seed + ADAPTER_SEED_OFFSETS["critic"])
        critic = Trained(*split_trained(critic_model))
    return Models(policy, actor, base, critic, ref_params)


def abstract_models(cfg: TrainConfig, policy_config: ModelConfig, mesh: Mesh) -> Models:
    """What :func:`models` builds, as structure and shapes only: every array a ``jax.ShapeDtypeStruct`` carrying
    its sharding on ``mesh`` (which may be another machine's compile-only devices). ``policy_config``: the policy's
    architecture (``model.path``'s ``config.json``; no weight is read). The critic, adapters and reference are
    the ones :func:`models` makes for the config (a ``critic.model_path`` / ``ref.model_path`` by its
    ``config.json``)."""
    seed, overrides = cfg.trainer.seed, checkpoint_overrides(cfg)

    def construct():
        policy = CausalLM(policy_config, rngs=nnx.Rngs(seed))
        critic = None
        if cfg.use_critic:
            # the policy's backbone with a value head (ValueModel.from_policy's structure), or critic.model_path's
            shape = read_config(cfg.critic.model_path, **overrides) if cfg.critic.model_path else policy_config
            critic = ValueModel(shape, rngs=nnx.Rngs(seed + 1))
        for model, role in ((policy, "actor"), (critic, "critic")):
            if model is not None and getattr(cfg, role).lora.enabled:
                attach_lora(model, getattr(cfg, role).lora, seed + ADAPTER_SEED_OFFSETS[role])
        return policy, critic

    policy, critic_model = nnx.eval_shape(construct)
    base = nnx.graphdef(nnx.eval_shape(lambda: CausalLM(policy_config, rngs=nnx.Rngs(seed))))
    reference = None
    if cfg.use_reference and (cfg.ref.model_path or not has_adapters(policy)):
        source = (nnx.eval_shape(lambda: CausalLM(read_config(cfg.ref.model_path, **overrides), rngs=nnx.Rngs(0)))
                  if cfg.ref.model_path else policy)
        reference = jax.eval_shape(lambda p: kept_in(p, reference_param_dtype(cfg), copy=False),
                                   nnx.state(source, nnx.Param))
    placed = lambda state: None if state is None else on_devices(state, mesh)  # noqa: E731
    actor = Trained(*split_trained(policy))
    actor = Trained(actor.graphdef, placed(actor.params), placed(actor.frozen))
    critic = None
    if critic_model is not None:
        critic = Trained(*split_trained(critic_model))
        critic = Trained(critic.graphdef, placed(critic.params), placed(critic.frozen))
    return Models(policy, actor, base if has_adapters(policy) else None, critic, placed(reference))


def on_devices(state: nnx.State, mesh: Mesh) -> nnx.State:
    """Abstract parameters with the sharding the rule table gives each on ``mesh``, as ``ShapeDtypeStruct``s."""
    from jppo.models.sharding import variable_spec  # noqa: PLC0415

    def place(variable: nnx.Variable) -> nnx.Variable:
        sharding = NamedSharding(mesh, variable_spec(variable, mesh))
        return variable.replace(jax.ShapeDtypeStruct(variable.shape, variable.dtype, sharding=sharding))

    return jax.tree.map(place, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
