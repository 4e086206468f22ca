"""The trainer's config validator: every value of a :class:`~jppo.config.TrainConfig` checked before anything is
built or compiled, each problem a :class:`~jppo.core.errors.ConfigError` of one line naming the key and the value as
the user wrote them.

:func:`check` (run by :func:`jppo.config.load_config`) checks names against the registries, numbers against the
ranges only the trainer gives them, and every setting against the limits of the component that uses it, by running
that component's own check (the sampler's, the policy loss's, the optimizer's, the update engine's, the model's, the
KL controller's) on it: its :class:`~jppo.core.errors.InvalidSetting` is reported under the config key
(:func:`_as_key`), so each limit is stated once, in the component that relies on it. Batch sizes are checked in
prompts, as written; :func:`check_mesh`, against a mesh's batch shards (the engine's check of its ``engine_view``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import os
import pathlib
from typing import Any, Optional, Sequence

from jppo.run import compile_cache
from jppo.advantages import ADVANTAGE_ESTIMATORS
from jppo.data import BUILTIN_TASKS
from jppo.data.datasets import file_list
from jppo.data.tokenizer import BUILTIN_PREFIX
from jppo.run.dynamic_sampling import FILTER_METRICS
from jppo.engine.config import check_old_log_prob, check_update
from jppo.engine.optim import check_optim
from jppo.engine.update import policy_options
from jppo.core.errors import ConfigError, InvalidSetting, one_line
from jppo.losses import (AGG_MODES, KL_KINDS, POLICY_LOSSES, ROLLOUT_CORRECTION_MODES, check_policy_loss_mode,
                          check_policy_options, required_agg_mode)
from jppo.rewards.verify import require_math_verify
from jppo.models.config import ATTENTION_IMPLEMENTATIONS, DTYPES, check_attention_blocks
from jppo.models.families import MODEL_FAMILIES
from jppo.models.layers import HALF_PRECISION_ATTENTION
from jppo.models.lora import check_fits
from jppo.core.paths import is_remote, missing_backend, run_path
from jppo.models.hf import read_config
from jppo.rollout import ROLLOUT_ENGINES, vllm_engine
from jppo.rollout.env import BUILTIN_ENVS
from jppo.config.schema import MAX_OFF_POLICY_STEPS, TrainConfig
from jppo.config.views import (
    CONTEXT_KEYS, SAMPLING_KEYS, adapted_model_config, engine_spec, engine_view, kl_controller, random_model_config,
    sampling_params,
)


def _choice(key: str, value: str, valid: Sequence[str]) -> None:
    if value not in valid:
        close = difflib.get_close_matches(value, list(valid), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{key}={value!r} is not valid{hint}; valid: {', '.join(valid)}")


def _positive(key: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key}={value!r} must be {'>= 0' if allow_zero else '> 0'}")


def _within(key: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise ConfigError(f"{key}={value!r} must be in [{low:g}, {high:g}]")


@contextlib.contextmanager
def _as_key(keys: dict[str, str], prefix: str = ""):
    """Runs a component's own check; its :class:`InvalidSetting` becomes a :class:`ConfigError` under the config
    key that holds the setting (``keys[name]``, else ``prefix + name``)."""
    try:
        yield
    except InvalidSetting as error:
        key = keys.get(error.name, f"{prefix}{error.name}" if prefix else None)
        raise ConfigError(error.renamed(key) if key else one_line(error)) from None


def _leaves(node: Any, prefix: str = ""):
    """``(dotted key, value)`` of every leaf of a config dataclass tree."""
    for field in dataclasses.fields(node):
        value = getattr(node, field.name)
        if dataclasses.is_dataclass(value):
            yield from _leaves(value, f"{prefix}{field.name}.")
        else:
            yield f"{prefix}{field.name}", value


def check(cfg: TrainConfig, data_files: bool = True) -> None:
    """Names against the registries, sizes against each other, and every setting against the limits of the
    component that uses it (the sampler's, the policy loss's, the optimizer's, the model's, ...), so a value a
    component would refuse at run time is refused here, before anything compiles. The mesh against the device
    count is checked by :func:`check_mesh`; files and plug-ins are read by :func:`jppo.run.build.load_inputs`.
    ``data_files`` False: the prompt files need not exist (what only needs shapes: compiling for a target)."""
    for key, value in _leaves(cfg):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}={value!r} must be a finite number")
    _check_sources(cfg, data_files)
    _check_reward(cfg)
    _check_model(cfg)
    for section in ("actor", "critic"):
        _check_update(cfg, section)
    _check_actor(cfg)
    _check_algorithm(cfg)
    _check_rollout(cfg)
    _check_trainer(cfg)
    _check_off_policy(cfg)
    _check_batch_sizes(cfg)


def _check_sources(cfg: TrainConfig, data_files: bool = True) -> None:
    for key in ("data.train_files", "data.val_files") if data_files else ():
        for item in file_list(getattr(cfg.data, key.split(".")[1]), key):
            if not pathlib.Path(item).is_file():
                raise ConfigError(f"{key}={item!r}: no such file")
    if cfg.data.task == "files" and not cfg.data.val_files:
        for key, value in (("trainer.val_every", cfg.trainer.val_every),
                           ("trainer.val_before_train", cfg.trainer.val_before_train)):
            if value:
                raise ConfigError(f"{key}={value!r} needs held-out prompts: with data.task='files' set "
                                  "data.val_files (or turn validation off)")
    for key in ("critic.model_path", "ref.model_path", "reward.model_path"):
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value is not None and not (pathlib.Path(value) / "config.json").is_file():
            raise ConfigError(f"{key}={value!r}: no Hugging Face checkpoint (config.json) there")


def _check_reward(cfg: TrainConfig) -> None:
    """An optional package a reward kind needs must be installed; the overlong buffer fits in the length limit."""
    buffer, limit = cfg.reward.overlong_buffer, cfg.rollout.max_response_length
    if buffer.enable and not 1 <= buffer.len < limit:
        raise ConfigError(f"reward.overlong_buffer.len={buffer.len!r} must be >= 1 and < "
                          f"rollout.max_response_length={limit}")
    if buffer.enable:
        _positive("reward.overlong_buffer.penalty_factor", buffer.penalty_factor, allow_zero=True)
    if cfg.reward.kind == "math_verify":
        try:
            require_math_verify()
        except ValueError as error:
            raise ConfigError(one_line(error)) from None


# Parameter dtypes too coarse to train in: an Adam step moves a weight by about lr (1e-6 for a fine-tune) while a
# weight of ~0.02 is stored with a spacing of ~1e-4 in bfloat16 (~1e-5 in float16), so the update rounds away.
HALF_PRECISION = ("bfloat16", "float16")


def _check_trained_param_dtype(param_dtype: str) -> None:
    """``model.param_dtype`` is the dtype of every trained model's weights (the actor's, and the critic's, which is
    built from the same section); mixed precision keeps them in float32 and computes in ``model.dtype``."""
    if param_dtype in HALF_PRECISION:
        raise ConfigError(f"model.param_dtype={param_dtype!r}: trained weights (actor, critic) in {param_dtype} lose "
                          "Adam's small updates to rounding; use float32 master weights with model.dtype: bfloat16 "
                          "(mixed precision)")


def _check_cudnn_dtype(key: str, dtype: str) -> None:
    """cuDNN's fused attention computes in bfloat16 or float16 only; ``model.attention: auto`` falls back by itself."""
    if dtype not in HALF_PRECISION_ATTENTION:
        raise ConfigError(f"{key}={dtype!r}: model.attention='cudnn' needs {' or '.join(HALF_PRECISION_ATTENTION)} "
                          "compute (use model.attention: auto to fall back)")


def _check_model(cfg: TrainConfig) -> None:
    _choice("model.model_type", cfg.model.model_type, MODEL_FAMILIES)
    _choice("model.dtype", cfg.model.dtype, list(DTYPES))
    _choice("model.param_dtype", cfg.model.param_dtype, list(DTYPES))
    _choice("model.attention", cfg.model.attention, ATTENTION_IMPLEMENTATIONS)
    if cfg.model.attention == "cudnn":  # the sampler's dtype too (default: model.dtype, checked first)
        for key, dtype in ("model.dtype", cfg.model.dtype), ("rollout.dtype", cfg.rollout.dtype or cfg.model.dtype):
            _check_cudnn_dtype(key, dtype)
    _check_trained_param_dtype(cfg.model.param_dtype)
    _choice("ref.param_dtype", cfg.ref.param_dtype or cfg.model.dtype, list(DTYPES))  # never trained: any dtype
    if cfg.model.path is not None and not (pathlib.Path(cfg.model.path) / "config.json").is_file():
        raise ConfigError(f"model.path={cfg.model.path!r}: no Hugging Face checkpoint (config.json) there")
    if cfg.model.path is None and cfg.model.tokenizer is None:
        task = cfg.data.task
        if task not in BUILTIN_TASKS:
            raise ConfigError(
                f"model.tokenizer is required for data.task={task!r} without model.path (built-in vocabularies "
                f"exist for: {', '.join(BUILTIN_TASKS)})"
            )
    with _as_key({}, prefix="model."):  # a checkpoint's block sizes too (it brings its shape, not those)
        check_attention_blocks(cfg.model.attention_block_q, cfg.model.attention_block_kv)
        if cfg.model.path is None:  # a model built from this section: its own checks
            random_model_config(cfg, None)


def _check_update(cfg: TrainConfig, section: str) -> None:
    """The engine's own checks of an update's settings (sizes in whatever unit they count) and its optimizer's."""
    update = getattr(cfg, section)
    _choice(f"{section}.loss_agg_mode", update.loss_agg_mode, AGG_MODES)
    with _as_key({}, prefix=f"{section}."):
        check_update(update)
    with _as_key({}, prefix=f"{section}.optim."):
        check_optim(update.optim)
    with _as_key({}, prefix=f"{section}.lora."):
        update.lora.check()
        if update.lora.enabled:
            check_fits(update.lora, adapted_model_config(cfg, section))


def _check_actor(cfg: TrainConfig) -> None:
    actor = cfg.actor
    _choice("actor.policy_loss", actor.policy_loss, sorted(POLICY_LOSSES))
    try:  # sequence-level losses (gspo, geo_mean) are means over sequences: the registry records their mode
        check_policy_loss_mode(actor.policy_loss, actor.loss_agg_mode)
    except ValueError:
        raise ConfigError(
            f"actor.loss_agg_mode={actor.loss_agg_mode!r}: actor.policy_loss={actor.policy_loss!r} needs "
            f"actor.loss_agg_mode={required_agg_mode(actor.policy_loss)!r}"
        ) from None
    with _as_key({}, prefix="actor."):
        check_policy_options(actor.policy_loss, policy_options(actor))
    _choice("actor.kl_loss_type", actor.kl_loss_type, KL_KINDS)
    if actor.rollout_correction.mode == "seq_mask":  # renamed when seq_* came to mean verl's product of ratios
        raise ConfigError("actor.rollout_correction.mode='seq_mask' was renamed 'geo_mask' (geometric mean, the rows "
                          "stay in N and S); verl's sequence rejection, which removes the rows, is 'seq_rs'")
    _choice("actor.rollout_correction.mode", actor.rollout_correction.mode, ROLLOUT_CORRECTION_MODES)
    with _as_key({}, prefix="actor.rollout_correction."):
        actor.rollout_correction.check()
    with _as_key({}, prefix="actor."):  # the choice, then the engine's own check of what it resolves to
        check_old_log_prob(engine_view(cfg, "actor"))
    _positive("actor.kl_loss_coef", actor.kl_loss_coef, allow_zero=True)
    _positive("critic.cliprange_value", cfg.critic.cliprange_value, allow_zero=True)


def _check_algorithm(cfg: TrainConfig) -> None:
    algorithm = cfg.algorithm
    _choice("algorithm.adv_estimator", algorithm.adv_estimator, sorted(ADVANTAGE_ESTIMATORS))
    _choice("algorithm.kl_penalty", algorithm.kl_penalty, KL_KINDS)
    _choice("algorithm.kl_ctrl.type", algorithm.kl_ctrl.type, ["fixed", "adaptive"])
    _within("algorithm.gamma", algorithm.gamma, 0.0, 1.0)
    _within("algorithm.lam", algorithm.lam, 0.0, 1.0)
    _positive("algorithm.kl_ctrl.kl_coef", algorithm.kl_ctrl.kl_coef, allow_zero=True)
    if algorithm.kl_ctrl.type == "adaptive":
        with _as_key({}, prefix="algorithm.kl_ctrl."):
            kl_controller(cfg)
    groups = algorithm.filter_groups
    _choice("algorithm.filter_groups.metric", groups.metric, FILTER_METRICS)
    _positive("algorithm.filter_groups.max_num_gen_batches", groups.max_num_gen_batches, allow_zero=True)
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
        with _as_key(keys):
            sampling_params(cfg, None, evaluation=use == "evaluation")
    _positive("rollout.prompt_bucket", cfg.rollout.prompt_bucket)
    _positive("rollout.max_turns", cfg.rollout.max_turns)
    env = cfg.rollout.env
    if env is not None and env.startswith(BUILTIN_PREFIX):
        _choice("rollout.env", env, [BUILTIN_PREFIX + name for name in BUILTIN_ENVS])
    if cfg.rollout.dtype is not None:
        _choice("rollout.dtype", cfg.rollout.dtype, [name for name in DTYPES if name != "float64"])
    _choice("rollout.engine", cfg.rollout.engine, ROLLOUT_ENGINES)
    if cfg.rollout.engine == "vllm":  # installed, its options, the policy's shape: before anything is built
        shape, keys = ((read_config(cfg.model.path), f"model.path={cfg.model.path!r}") if cfg.model.path
                       else (random_model_config(cfg, None), "model.hidden_size / model.num_heads"))
        vllm_engine.check_settings(cfg.rollout.vllm, shape, keys, engine_spec(cfg, None).max_model_len, CONTEXT_KEYS)


def _check_output_dir(output_dir: str) -> None:
    """The run's directory must be one the trainer can create or write into (nothing is created here)."""
    if not output_dir.strip():
        raise ConfigError(f"trainer.output_dir={output_dir!r} must name a directory")
    if is_remote(output_dir):  # a cloud URI: written through epath; whether the bucket exists is seen at run time
        problem = missing_backend(output_dir)
        if problem:
            raise ConfigError(f"trainer.output_dir={output_dir!r}: {problem}")
        return
    _check_local_dir("trainer.output_dir", output_dir)


def _check_local_dir(key: str, value: str) -> None:
    """A local folder the run can create or write into: its nearest existing ancestor is a writable directory."""
    path = pathlib.Path(os.path.expanduser(value)).absolute()
    existing = next(parent for parent in (path, *path.parents) if parent.exists())
    if not existing.is_dir():
        raise ConfigError(f"{key}={value!r}: {str(existing)!r} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}={value!r}: {str(existing)!r} is not writable")


def _check_compilation_cache(value: Optional[str]) -> None:
    """``auto``, ``off`` (or one of their spellings) or an absolute local folder the run can create
    (:func:`jppo.run.compile_cache.folder`)."""
    if compile_cache.normalize(value) in (compile_cache.AUTO, compile_cache.OFF):
        return
    with _as_key({}, prefix="trainer."):
        compile_cache.folder(value)
    _check_local_dir("trainer.compilation_cache", value)


def _check_trainer(cfg: TrainConfig) -> None:
    from jppo.run.checkpoint import resolve_resume  # noqa: PLC0415 (orbax: imported when a config is checked)

    trainer = cfg.trainer
    _positive("trainer.total_steps", trainer.total_steps)
    _positive("trainer.save_every", trainer.save_every, allow_zero=True)
    _positive("trainer.val_every", trainer.val_every, allow_zero=True)
    _positive("trainer.max_checkpoints_to_keep", trainer.max_checkpoints_to_keep)
    _positive("trainer.critic_warmup", trainer.critic_warmup, allow_zero=True)
    if not 0 <= trainer.seed < 2**32:
        raise ConfigError(f"trainer.seed={trainer.seed!r} must be in [0, 2**32)")
    _check_output_dir(trainer.output_dir)
    _check_compilation_cache(trainer.compilation_cache)
    _check_logger(trainer.logger)
    _positive("trainer.log_val_generations", trainer.log_val_generations, allow_zero=True)
    try:
        resolve_resume(trainer.resume, run_path(trainer.output_dir) / "checkpoints")
    except ValueError as error:
        raise ConfigError(one_line(error)) from None


def _check_off_policy(cfg: TrainConfig) -> None:
    """``trainer.off_policy_steps`` in range, and nothing that needs the batch sampled by the weights it trains."""
    k = cfg.trainer.off_policy_steps  # an integer: the typed schema refuses anything else when it loads
    key = f"trainer.off_policy_steps={k!r}"
    _within("trainer.off_policy_steps", k, 0, MAX_OFF_POLICY_STEPS)
    if not k:
        return
    if cfg.actor.old_log_prob == "rollout":
        raise ConfigError(f"actor.old_log_prob='rollout' with {key}: the sampler's log-probs are the behaviour "
                          "policy's, up to k updates behind the trained weights, and the PPO ratio needs the proximal "
                          "(trained) weights' (use auto or recompute; actor.rollout_correction corrects the gap)")
    if cfg.algorithm.filter_groups.enable:
        raise ConfigError(f"algorithm.filter_groups.enable=True with {key}: dynamic sampling draws as many batches as "
                          "it takes to fill the step with varied groups, which the one background batch per step "
                          "does not do (turn one of them off)")


def _check_logger(sinks: list[str]) -> None:
    """Known sink names, each once; ``wandb`` only where its package imports (it is an optional extra)."""
    from jppo.runlog import SINKS, import_wandb  # noqa: PLC0415 (an import cycle through jppo.config)

    for name in sinks:
        _choice("trainer.logger", name, SINKS)
    if len(set(sinks)) < len(sinks):
        raise ConfigError(f"trainer.logger={list(sinks)!r} names a sink twice")
    if "wandb" in sinks:
        try:
            import_wandb()
        except ImportError as error:
            raise ConfigError(f"trainer.logger={list(sinks)!r}: {error}") from None


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
