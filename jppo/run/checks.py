"""The components' checks of a config: importing this module registers them (:data:`jppo.core.checks.CONFIG_CHECKS`).

Each check runs a component's own check on the setting it is given (the sampler's, the policy loss's, the
optimizer's, the update engine's, the model's, the KL controller's): its :class:`~jppo.core.errors.InvalidSetting`
is reported under the config key (:func:`~jppo.core.checks.as_key`), so each limit is stated once, in the component
that relies on it, and names are checked against the registries the components fill. Importing this module also
loads every module that registers a check of its own (the built-in tasks, the reward kinds, the compilation cache,
dynamic sampling, the log sinks). Every command imports it before it reads its config (:func:`jppo.cli.load_config`),
and so does :mod:`jppo.run.build`; :func:`jppo.config.check.check` then runs them after its own.
"""

from __future__ import annotations

import jppo.data.tasks  # noqa: F401 (registers data.task's check)
import jppo.parallel.compile_cache  # noqa: F401 (registers trainer.compilation_cache's check)
import jppo.rewards.code  # noqa: F401 (registers reward.code's check)
import jppo.rewards.reward_fn  # noqa: F401 (registers reward.kind's check)
import jppo.run.checkpoint  # noqa: F401 (registers trainer.resume's check)
import jppo.run.filters  # noqa: F401 (registers algorithm.filter_groups.metric's check)
import jppo.runlog  # noqa: F401 (registers trainer.logger's check)
from jppo.advantages import ADVANTAGE_ESTIMATORS
from jppo.config.applies import EXPERT_KEYS
from jppo.config.schema import TrainConfig
from jppo.config.views import (
    CONTEXT_KEYS,
    SAMPLING_KEYS,
    adapted_model_config,
    engine_view,
    kl_controller,
    random_model_config,
    rollout_engine_spec,
    sampling_params,
)
from jppo.core.checks import as_key, choice, register_config_check
from jppo.core.errors import ConfigError, one_line
from jppo.core.inputs import BUILTIN_PREFIX
from jppo.engine.config import check_old_log_prob, check_update
from jppo.engine.objectives import policy_options
from jppo.engine.optim import check_optim
from jppo.losses import (
    AGG_MODES,
    KL_KINDS,
    POLICY_LOSSES,
    ROLLOUT_CORRECTION_MODES,
    check_policy_loss_mode,
    check_policy_options,
    required_agg_mode,
)
from jppo.models.config import ATTENTION_IMPLEMENTATIONS, DTYPES, check_attention_blocks
from jppo.models.families import MODEL_FAMILIES
from jppo.models.hf import read_config
from jppo.models.layers import HALF_PRECISION_ATTENTION
from jppo.models.lora import check_fits, check_saved_adapters, saved_adapter_config
from jppo.rollout import ROLLOUT_ENGINES, vllm_engine
from jppo.rollout.env import BUILTIN_ENVS


@register_config_check("components")
def check_components(cfg: TrainConfig) -> None:
    """The model's, the actor's update's (an SFT run's too) and the sampler's checks."""
    _check_model(cfg)
    _check_update(cfg, "actor")
    _check_kept_adapters(cfg)
    _check_rollout(cfg)


@register_config_check("components of RL runs", rl_only=True)
def check_rl_components(cfg: TrainConfig) -> None:
    """The critic's update, the policy loss's, the estimator's and the batch sizes' checks: what only RL runs
    read (an SFT config refuses those keys when set, :func:`jppo.config.applies.check_sft_keys`)."""
    _check_update(cfg, "critic")
    _check_actor(cfg)
    _check_algorithm(cfg)
    _check_batch_sizes(cfg)


def _check_cudnn_dtype(key: str, dtype: str) -> None:
    """cuDNN's fused attention computes in bfloat16 or float16 only; ``model.attention: auto`` falls back by itself."""
    if dtype not in HALF_PRECISION_ATTENTION:
        raise ConfigError(f"{key}={dtype!r}: model.attention='cudnn' needs {' or '.join(HALF_PRECISION_ATTENTION)} "
                          "compute (use model.attention: auto to fall back)")


def _check_model(cfg: TrainConfig) -> None:
    choice("model.model_type", cfg.model.model_type, MODEL_FAMILIES)
    choice("model.dtype", cfg.model.dtype, list(DTYPES))
    choice("model.param_dtype", cfg.model.param_dtype, list(DTYPES))
    choice("model.attention", cfg.model.attention, ATTENTION_IMPLEMENTATIONS)
    if cfg.model.attention == "cudnn":  # the sampler's dtype too (default: model.dtype, checked first)
        for key, dtype in ("model.dtype", cfg.model.dtype), ("rollout.dtype", cfg.rollout.dtype or cfg.model.dtype):
            _check_cudnn_dtype(key, dtype)
    choice("ref.param_dtype", cfg.ref.param_dtype or cfg.model.dtype, list(DTYPES))  # never trained: any dtype
    with as_key({}, prefix="model."):  # a checkpoint's block sizes too (it brings its shape, not those)
        check_attention_blocks(cfg.model.attention_block_q, cfg.model.attention_block_kv)
        if cfg.model.path is None:  # a model built from this section: its own checks
            random_model_config(cfg, None)
    _check_expert_keys(cfg)


def _check_expert_keys(cfg: TrainConfig) -> None:
    """A key only a model with experts reads is refused, set, on a run none of whose models has a layer with
    experts (it would do nothing)."""
    set_keys = {}
    for key, default in EXPERT_KEYS.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if (tuple(value) if isinstance(value, (list, tuple)) else value) != default:
            set_keys[key] = list(value) if isinstance(value, (list, tuple)) else value
    if not set_keys or any(adapted_model_config(cfg, role).sparse_layers for role in cfg.roles):
        return  # (a checkpoint's config.json is read only when such a key is set)
    key, value = next(iter(set_keys.items()))
    raise ConfigError(f"{key}={value!r} applies to a model with experts, and this run's model "
                      f"({cfg.model.path or cfg.model.model_type!r}) has no layer with experts")


def _check_kept_adapters(cfg: TrainConfig) -> None:
    """A ``model.path`` holding LoRA adapters beside its weights (``python -m jppo.export --keep-adapters``) is
    trained on with the same ``actor.lora``: rank, alpha and targets as saved."""
    saved = saved_adapter_config(cfg.model.path) if cfg.model.path else None
    if saved is not None:
        try:
            check_saved_adapters(saved, cfg.actor.lora, adapted_model_config(cfg, "actor"),
                                 f"model.path={cfg.model.path!r}")
        except ValueError as error:
            raise ConfigError(one_line(error)) from None


def _check_update(cfg: TrainConfig, role: str) -> None:
    """The engine's own checks of an update's settings (sizes in whatever unit they count) and its optimizer's."""
    update = getattr(cfg, role)
    choice(f"{role}.loss_agg_mode", update.loss_agg_mode, AGG_MODES)
    with as_key({}, prefix=f"{role}."):
        check_update(update)
    with as_key({}, prefix=f"{role}.optim."):
        check_optim(update.optim)
    with as_key({}, prefix=f"{role}.lora."):
        if update.lora.enabled:
            check_fits(update.lora, adapted_model_config(cfg, role))


def _check_actor(cfg: TrainConfig) -> None:
    actor = cfg.actor
    choice("actor.policy_loss", actor.policy_loss, sorted(POLICY_LOSSES))
    try:  # sequence-level losses (gspo, geo_mean) are means over sequences: the registry records their mode
        check_policy_loss_mode(actor.policy_loss, actor.loss_agg_mode)
    except ValueError:
        raise ConfigError(
            f"actor.loss_agg_mode={actor.loss_agg_mode!r}: actor.policy_loss={actor.policy_loss!r} needs "
            f"actor.loss_agg_mode={required_agg_mode(actor.policy_loss)!r}"
        ) from None
    with as_key({}, prefix="actor."):
        check_policy_options(actor.policy_loss, policy_options(actor))
    choice("actor.kl_loss_type", actor.kl_loss_type, KL_KINDS)
    if actor.rollout_correction.mode == "seq_mask":  # renamed when seq_* came to mean verl's product of ratios
        raise ConfigError("actor.rollout_correction.mode='seq_mask' was renamed 'geo_mask' (geometric mean, the rows "
                          "stay in N and S); verl's sequence rejection, which removes the rows, is 'seq_rs'")
    choice("actor.rollout_correction.mode", actor.rollout_correction.mode, ROLLOUT_CORRECTION_MODES)
    with as_key({}, prefix="actor.rollout_correction."):
        actor.rollout_correction.check()
    with as_key({}, prefix="actor."):  # the choice, then the engine's own check of what it resolves to
        check_old_log_prob(engine_view(cfg, "actor"))
    _check_routing_replay(cfg)


ROUTING_REPLAY_MODES = ("none", "rollout")


def _check_routing_replay(cfg: TrainConfig) -> None:
    """``actor.routing_replay: rollout`` needs a model with experts, sampled by jppo's sampler (which records the
    experts), one turn per response (a multi-turn response's record would be the turns' records joined)."""
    mode = cfg.actor.routing_replay
    choice("actor.routing_replay", mode, ROUTING_REPLAY_MODES)
    if mode == "none":
        return
    key = f"actor.routing_replay={mode!r}"
    if not adapted_model_config(cfg, "actor").sparse_layers:
        raise ConfigError(f"{key}: the policy ({cfg.model.path or cfg.model.model_type!r}) has no layer with experts, "
                          "so there is no routing to replay: use actor.routing_replay: none")
    if cfg.rollout.engine != "jppo":
        raise ConfigError(f"{key} with rollout.engine={cfg.rollout.engine!r}: jppo does not read the experts vLLM "
                          "routed (its enable_return_routed_experts) yet; sample with rollout.engine: jppo, or use "
                          "actor.routing_replay: none")
    if cfg.rollout.env is not None:
        raise ConfigError(f"{key} with rollout.env={cfg.rollout.env!r}: a multi-turn rollout does not record the "
                          "experts of its turns yet; use actor.routing_replay: none")


def _check_algorithm(cfg: TrainConfig) -> None:
    algorithm = cfg.algorithm
    choice("algorithm.adv_estimator", algorithm.adv_estimator, sorted(ADVANTAGE_ESTIMATORS))
    choice("algorithm.kl_penalty", algorithm.kl_penalty, KL_KINDS)
    choice("algorithm.kl_ctrl.type", algorithm.kl_ctrl.type, ["fixed", "adaptive"])
    if algorithm.kl_ctrl.type == "adaptive":
        with as_key({}, prefix="algorithm.kl_ctrl."):
            kl_controller(cfg)
    groups = algorithm.filter_groups
    estimator = ADVANTAGE_ESTIMATORS[algorithm.adv_estimator]
    for needs_groups, what in ((groups.enable, "algorithm.filter_groups.enable=True drops groups whose responses "
                                "agree"), (estimator.needs_group_ids, f"algorithm.adv_estimator="
                                           f"{algorithm.adv_estimator!r} compares the responses of one prompt")):
        if needs_groups and cfg.rollout.n < 2:
            raise ConfigError(f"rollout.n={cfg.rollout.n}: {what}, so it needs rollout.n >= 2")
    if estimator.needs_critic and cfg.critic.enable is False:
        raise ConfigError(f"critic.enable=False but algorithm.adv_estimator={algorithm.adv_estimator!r} needs a critic")


def _check_rollout(cfg: TrainConfig) -> None:
    for use, keys in SAMPLING_KEYS.items():
        with as_key(keys):
            sampling_params(cfg, None, evaluation=use == "evaluation")
    env = cfg.rollout.env
    if env is not None and env.startswith(BUILTIN_PREFIX):
        choice("rollout.env", env, [BUILTIN_PREFIX + name for name in BUILTIN_ENVS])
    if cfg.rollout.dtype is not None:
        choice("rollout.dtype", cfg.rollout.dtype, [name for name in DTYPES if name != "float64"])
    choice("rollout.engine", cfg.rollout.engine, ROLLOUT_ENGINES)
    if cfg.rollout.engine == "vllm":  # installed, its options, the policy's shape: before anything is built
        shape, keys = ((read_config(cfg.model.path), f"model.path={cfg.model.path!r}") if cfg.model.path
                       else (random_model_config(cfg, None), "model.hidden_size / model.num_heads"))
        vllm_engine.check_settings(
            cfg.rollout.vllm, shape, keys, rollout_engine_spec(cfg, None).max_model_len, CONTEXT_KEYS
        )


def _check_batch_sizes(cfg: TrainConfig) -> None:
    """What holds on any mesh, in the units the user wrote (the engine's cut on a mesh: :func:`check_mesh`)."""
    prompts = cfg.data.train_batch_size
    longest = cfg.data.max_prompt_length + cfg.rollout.max_response_length
    for role in cfg.roles:
        update = getattr(cfg, role)
        if prompts % update.ppo_mini_batch_size:
            raise ConfigError(
                f"{role}.ppo_mini_batch_size={update.ppo_mini_batch_size} (prompts) does not divide "
                f"data.train_batch_size={prompts}"
            )
        # token-budget packing puts every sequence whole into one row of ppo_max_token_len tokens
        if update.use_dynamic_bsz and update.ppo_max_token_len < longest:
            raise ConfigError(
                f"{role}.ppo_max_token_len={update.ppo_max_token_len} must be >= the longest sequence, "
                f"data.max_prompt_length + rollout.max_response_length = {longest} tokens"
            )
