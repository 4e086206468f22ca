"""The trainer's configuration: one typed schema, loaded from YAML plus ``key.sub=value`` overrides, validated once.

The schema is a tree of frozen dataclasses with verl's section and key names (``data``, ``model``, ``actor``,
``critic``, ``ref``, ``rollout``, ``reward``, ``algorithm``, ``mesh``, ``trainer``). OmegaConf merges the file and
the overrides onto it and checks keys and types; :func:`validate` then checks names against the registries and
batch sizes against each other. Every problem is a :class:`ConfigError` whose message is one line naming the key
and the value; the command-line entry points print it and exit with status 2, before anything is compiled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import os
import pathlib
from typing import Any, Optional, Sequence

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from jppo.advantages import ADVANTAGE_ESTIMATORS
from jppo.data import BUILTIN_TASKS, DataConfig
from jppo.engine.config import ActorConfig, CriticConfig, NORMALIZATIONS
from jppo.engine.optim import check_optim
from jppo.engine.update import policy_options
from jppo.errors import InvalidSetting
from jppo.losses import (
    AGG_MODES, KL_KINDS, POLICY_LOSSES, AdaptiveKLController, check_policy_options, required_agg_mode,
)
from jppo.models.config import DTYPES, SUPPORTED_MODEL_TYPES
from jppo.rewards import RewardConfig


class ConfigError(ValueError):
    """A configuration problem, stated in one line that names the key and the value."""


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """The policy. ``path``: a local Hugging Face checkpoint directory; without it a model of the shape below is
    initialised at random (``trainer.seed``). ``tokenizer``: a directory holding ``tokenizer.json`` (default:
    ``path``), or ``builtin:<task>`` for a built-in task's character vocabulary (the default without ``path``)."""

    path: Optional[str] = None
    tokenizer: Optional[str] = None
    model_type: str = "qwen2"
    hidden_size: int = 64
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: Optional[int] = None
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 512
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: bool = False


@dataclasses.dataclass(frozen=True)
class CriticSection(CriticConfig):
    """The critic: a value head on the policy's backbone (initialised from the policy checkpoint, as verl does).
    ``enable: null`` builds it only when ``algorithm.adv_estimator`` needs one (gae)."""

    enable: Optional[bool] = None
    model_path: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class RefSection:
    """The reference policy for KL terms, kept only when a KL term needs it. ``model_path`` defaults to the
    policy's initial weights."""

    model_path: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class RolloutSection:
    """Sampling with the KV-cache sampler. ``n`` responses per prompt; validation samples ``val_n`` per prompt
    at ``val_temperature`` (0: greedy). Prompt lengths are padded up to a multiple of ``prompt_bucket`` tokens so
    the sampler compiles once per bucket."""

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_response_length: int = 16
    prompt_bucket: int = 16
    val_n: int = 1
    val_temperature: float = 0.0
    log_prob_micro_batch_size: Optional[int] = None  # sequences per shard in forward passes; default: actor's


@dataclasses.dataclass(frozen=True)
class KLControlSection:
    type: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: int = 10000


@dataclasses.dataclass(frozen=True)
class AlgorithmSection:
    """Advantages and KL in the reward (verl's ``algorithm`` section)."""

    adv_estimator: str = "gae"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLControlSection = dataclasses.field(default_factory=KLControlSection)


@dataclasses.dataclass(frozen=True)
class MeshSection:
    """Mesh shape; one axis may be -1 (the remaining devices). Batch rows shard over data x fsdp."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1


@dataclasses.dataclass(frozen=True)
class TrainerSection:
    """The loop. ``val_every`` steps (0: never) and, with ``val_before_train``, once before the first step, the
    policy is validated on held-out prompts (``rollout.val_*``); the latter is logged at step 0, as verl logs it at
    global step 0, and is not repeated when a run resumes."""

    total_steps: int = 100
    output_dir: str = "runs/default"
    seed: int = 0
    save_every: int = 0  # 0: only at the end
    resume: str = "auto"  # auto | never | PATH
    max_checkpoints_to_keep: int = 2
    val_every: int = 0  # 0: no validation
    val_before_train: bool = False
    export_hf: bool = False
    tensorboard: bool = True
    progress_bar: bool = True
    plots: bool = True
    critic_warmup: int = 0  # steps that train only the critic


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    actor: ActorConfig = dataclasses.field(default_factory=ActorConfig)
    critic: CriticSection = dataclasses.field(default_factory=CriticSection)
    ref: RefSection = dataclasses.field(default_factory=RefSection)
    rollout: RolloutSection = dataclasses.field(default_factory=RolloutSection)
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    algorithm: AlgorithmSection = dataclasses.field(default_factory=AlgorithmSection)
    mesh: MeshSection = dataclasses.field(default_factory=MeshSection)
    trainer: TrainerSection = dataclasses.field(default_factory=TrainerSection)

    @property
    def use_critic(self) -> bool:
        if self.critic.enable is not None:
            return self.critic.enable
        return ADVANTAGE_ESTIMATORS[self.algorithm.adv_estimator].needs_critic

    @property
    def use_reference(self) -> bool:
        return self.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    @property
    def loss_scale_factor(self) -> float:
        return float(self.actor.loss_scale_factor or self.rollout.max_response_length)


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())


def _omegaconf_message(error: OmegaConfBaseException) -> str:
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    key = getattr(error, "full_key", None)
    return f"{key}: {text}" if key and key not in text else text


def _reset_options_of_a_replaced_task(file_layer, command_line: list) -> None:
    """A ``data.task`` given on the command line that differs from the file's starts from that task's own default
    options plus those given with it: the file's ``data.task_options`` belong to the file's task (merged, they would
    reach the new task, which rejects them)."""
    tasks = [layer.data.task for layer in command_line
             if isinstance(layer.get("data"), DictConfig) and "task" in layer.data]
    if not tasks or not isinstance(file_layer, DictConfig) or not isinstance(file_layer.get("data"), DictConfig):
        return
    if file_layer.data.get("task") != tasks[-1] and "task_options" in file_layer.data:
        del file_layer.data["task_options"]


def _merged(merged, layer, where: str):
    """``merged`` with ``layer`` merged on top; a mismatch is a :class:`ConfigError` naming ``where``."""
    try:
        return OmegaConf.merge(merged, layer)
    except OmegaConfBaseException as error:
        raise ConfigError(_omegaconf_message(error)) from None
    except (TypeError, ValueError) as error:  # e.g. a list where the schema has a mapping
        raise ConfigError(f"{where} is invalid: {_one_line(error)}") from None


def _override_layer(item: str):
    """One ``key.sub=value`` override as a config layer; the value is parsed as YAML (a number, a list, ...)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form key.sub=value")
    try:
        return OmegaConf.from_dotlist([item])
    except Exception as error:  # yaml's parser errors are not ValueErrors
        raise ConfigError(f"override {item!r} is not valid YAML ({_one_line(error)})") from None


def load_config(path: str | pathlib.Path | None, overrides: Sequence[str] = ()) -> TrainConfig:
    """The schema defaults, then the YAML file, then ``key.sub=value`` overrides; validated and frozen.

    Layers are merged one at a time, so a value of the wrong shape is reported with the override (or file) that
    brought it. Replacing ``data.task`` on the command line drops the file's ``data.task_options``
    (:func:`_reset_options_of_a_replaced_task`)."""
    merged = OmegaConf.structured(TrainConfig)
    layers = [(_override_layer(item), item) for item in overrides]
    if path is not None:
        path = pathlib.Path(path)
        if not path.is_file():
            raise ConfigError(f"--config {str(path)!r}: no such file")
        try:
            layer = OmegaConf.load(path)
        except Exception as error:  # yaml errors come in several classes
            raise ConfigError(f"--config {str(path)!r}: not valid YAML ({_one_line(error)})") from None
        _reset_options_of_a_replaced_task(layer, [override for override, _ in layers])
        merged = _merged(merged, layer, f"--config {str(path)!r}")
    for layer, item in layers:
        merged = _merged(merged, layer, f"override {item!r}")
    try:
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as error:
        raise ConfigError(_omegaconf_message(error)) from None
    except ValueError as error:  # a section's own check (its message names the key)
        raise ConfigError(_one_line(error)) from None
    validate(cfg)
    return cfg


def to_dict(cfg: TrainConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def save_config(cfg: TrainConfig, path: str | pathlib.Path) -> None:
    """The resolved configuration as YAML (what the run actually used)."""
    pathlib.Path(path).write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))


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
        raise ConfigError(error.renamed(key) if key else _one_line(error)) from None


def _leaves(node: Any, prefix: str = ""):
    """``(dotted key, value)`` of every leaf of a config dataclass tree."""
    for field in dataclasses.fields(node):
        value = getattr(node, field.name)
        if dataclasses.is_dataclass(value):
            yield from _leaves(value, f"{prefix}{field.name}.")
        else:
            yield f"{prefix}{field.name}", value


def validate(cfg: TrainConfig) -> None:
    """Names against the registries, sizes against each other, and every setting against the limits of the
    component that uses it (the sampler's, the policy loss's, the optimizer's, the model's, ...), so a value a
    component would refuse at run time is refused here, before anything compiles. The mesh against the device
    count is checked by :func:`check_mesh`; files and plug-ins are read by :func:`jppo.build.load_inputs`."""
    for key, value in _leaves(cfg):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}={value!r} must be a finite number")
    _check_sources(cfg)
    _check_model(cfg)
    for section in ("actor", "critic"):
        _check_update(cfg, section)
    _check_actor(cfg)
    _check_algorithm(cfg)
    _check_rollout(cfg)
    _check_trainer(cfg)
    _check_batch_sizes(cfg)


def _check_sources(cfg: TrainConfig) -> None:
    for key in ("data.train_files", "data.val_files"):
        value = getattr(cfg.data, key.split(".")[1])
        for item in (value or "").split(","):
            if item.strip() and not pathlib.Path(item.strip()).is_file():
                raise ConfigError(f"{key}={item.strip()!r}: no such file")
    if cfg.data.task == "files" and not cfg.data.train_files:
        raise ConfigError("data.train_files is required with data.task='files'")
    if cfg.data.task == "files" and not cfg.data.val_files:
        for key, value in (("trainer.val_every", cfg.trainer.val_every),
                           ("trainer.val_before_train", cfg.trainer.val_before_train)):
            if value:
                raise ConfigError(
                    f"{key}={value!r} needs held-out prompts: with data.task='files' set data.val_files "
                    "(or turn validation off)"
                )
    for key in ("critic.model_path", "ref.model_path", "reward.model_path"):
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value is not None and not (pathlib.Path(value) / "config.json").is_file():
            raise ConfigError(f"{key}={value!r}: no Hugging Face checkpoint (config.json) there")


def _check_model(cfg: TrainConfig) -> None:
    _choice("model.model_type", cfg.model.model_type, SUPPORTED_MODEL_TYPES)
    _choice("model.dtype", cfg.model.dtype, list(DTYPES))
    _choice("model.param_dtype", cfg.model.param_dtype, list(DTYPES))
    if cfg.model.path is not None and not (pathlib.Path(cfg.model.path) / "config.json").is_file():
        raise ConfigError(f"model.path={cfg.model.path!r}: no Hugging Face checkpoint (config.json) there")
    if cfg.model.path is None and cfg.model.tokenizer is None:
        task = cfg.data.task
        if task not in BUILTIN_TASKS:
            raise ConfigError(
                f"model.tokenizer is required for data.task={task!r} without model.path (built-in vocabularies "
                f"exist for: {', '.join(BUILTIN_TASKS)})"
            )
    if cfg.model.path is None:  # a model built from this section: its own checks (a checkpoint brings its shape)
        from jppo.build import random_model_config  # noqa: PLC0415 (build imports this module)

        with _as_key({}, prefix="model."):
            random_model_config(cfg, None)


def _check_update(cfg: TrainConfig, section: str) -> None:
    update = getattr(cfg, section)
    _choice(f"{section}.loss_agg_mode", update.loss_agg_mode, AGG_MODES)
    _choice(f"{section}.normalization", update.normalization, NORMALIZATIONS)
    _choice(f"{section}.optim.name", update.optim.name, ["adamw", "sgd"])
    _choice(f"{section}.optim.lr_schedule", update.optim.lr_schedule, ["constant", "cosine"])
    for key in ("ppo_mini_batch_size", "ppo_micro_batch_size", "ppo_max_token_len", "ppo_epochs", "logprob_chunk_size"):
        _positive(f"{section}.{key}", getattr(update, key))
    if update.loss_scale_factor is not None:
        _positive(f"{section}.loss_scale_factor", update.loss_scale_factor)
    with _as_key({}, prefix=f"{section}.optim."):
        check_optim(update.optim)


def _check_actor(cfg: TrainConfig) -> None:
    actor = cfg.actor
    _choice("actor.policy_loss", actor.policy_loss, sorted(POLICY_LOSSES))
    # Sequence-level losses (gspo, geo_mean) are means over sequences: the registry records the mode they need.
    needed = required_agg_mode(actor.policy_loss)
    if needed is not None and actor.loss_agg_mode != needed:
        raise ConfigError(
            f"actor.loss_agg_mode={actor.loss_agg_mode!r}: actor.policy_loss={actor.policy_loss!r} needs "
            f"actor.loss_agg_mode={needed!r}"
        )
    with _as_key({}, prefix="actor."):
        check_policy_options(actor.policy_loss, policy_options(actor))
    _choice("actor.kl_loss_type", actor.kl_loss_type, KL_KINDS)
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
        ctrl = algorithm.kl_ctrl
        with _as_key({}, prefix="algorithm.kl_ctrl."):
            AdaptiveKLController(init_kl_coef=ctrl.kl_coef, target_kl=ctrl.target_kl, horizon=ctrl.horizon)
    estimator = ADVANTAGE_ESTIMATORS[algorithm.adv_estimator]
    if estimator.needs_critic and cfg.critic.enable is False:
        raise ConfigError(f"critic.enable=False but algorithm.adv_estimator={algorithm.adv_estimator!r} needs a critic")
    if estimator.needs_group_ids and cfg.rollout.n < 2:
        raise ConfigError(
            f"rollout.n={cfg.rollout.n}: algorithm.adv_estimator={algorithm.adv_estimator!r} compares the "
            "responses of one prompt, so it needs rollout.n >= 2"
        )


# The sampler's settings (SamplingParams fields) and the config keys that give them, per use.
_SAMPLING_KEYS = {
    "training": {"n": "rollout.n", "temperature": "rollout.temperature", "top_k": "rollout.top_k",
                 "top_p": "rollout.top_p", "max_new_tokens": "rollout.max_response_length"},
    "validation": {"n": "rollout.val_n", "temperature": "rollout.val_temperature",
                   "max_new_tokens": "rollout.max_response_length"},
}


def _check_rollout(cfg: TrainConfig) -> None:
    from jppo.build import sampling_params  # noqa: PLC0415 (build imports this module)

    for use, keys in _SAMPLING_KEYS.items():
        with _as_key(keys):
            sampling_params(cfg, None, validation=use == "validation")
    _positive("rollout.prompt_bucket", cfg.rollout.prompt_bucket)


def _check_output_dir(output_dir: str) -> None:
    """The run's directory must be one the trainer can create or write into (nothing is created here)."""
    if not output_dir.strip():
        raise ConfigError(f"trainer.output_dir={output_dir!r} must name a directory")
    path = pathlib.Path(output_dir).absolute()
    existing = next(parent for parent in (path, *path.parents) if parent.exists())
    if not existing.is_dir():
        raise ConfigError(f"trainer.output_dir={output_dir!r}: {str(existing)!r} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"trainer.output_dir={output_dir!r}: {str(existing)!r} is not writable")


def _check_trainer(cfg: TrainConfig) -> None:
    from jppo.checkpoint import resolve_resume  # noqa: PLC0415 (orbax: imported when a config is checked)

    trainer = cfg.trainer
    _positive("trainer.total_steps", trainer.total_steps)
    _positive("trainer.save_every", trainer.save_every, allow_zero=True)
    _positive("trainer.val_every", trainer.val_every, allow_zero=True)
    _positive("trainer.max_checkpoints_to_keep", trainer.max_checkpoints_to_keep)
    _positive("trainer.critic_warmup", trainer.critic_warmup, allow_zero=True)
    if not 0 <= trainer.seed < 2**32:
        raise ConfigError(f"trainer.seed={trainer.seed!r} must be in [0, 2**32)")
    _check_output_dir(trainer.output_dir)
    try:
        resolve_resume(trainer.resume, pathlib.Path(trainer.output_dir) / "checkpoints")
    except ValueError as error:
        raise ConfigError(_one_line(error)) from None


def _check_batch_sizes(cfg: TrainConfig) -> None:
    prompts = cfg.data.train_batch_size
    for section in ("actor", "critic"):
        update = getattr(cfg, section)
        if section == "critic" and not cfg.use_critic:
            continue
        mini = update.ppo_mini_batch_size
        if prompts % mini:
            raise ConfigError(
                f"{section}.ppo_mini_batch_size={mini} prompts does not divide data.train_batch_size={prompts}"
            )
        # token-budget packing puts every sequence whole into one row of ppo_max_token_len tokens
        longest = cfg.data.max_prompt_length + cfg.rollout.max_response_length
        if update.use_dynamic_bsz and update.ppo_max_token_len < longest:
            raise ConfigError(
                f"{section}.ppo_max_token_len={update.ppo_max_token_len} must be >= the longest sequence, "
                f"data.max_prompt_length + rollout.max_response_length = {longest} tokens"
            )


def check_mesh(cfg: TrainConfig, num_devices: int, num_processes: int = 1) -> tuple[int, int, int]:
    """The mesh shape for ``num_devices``, and every batch size checked against the batch shards it implies."""
    from jppo.engine.driver import check_batch_sizes
    from jppo.mesh import resolve_shape

    try:
        shape = resolve_shape(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, num_devices)
    except ValueError as error:
        raise ConfigError(_one_line(error)) from None
    shards = shape[0] * shape[1]
    sequences = cfg.data.train_batch_size * cfg.rollout.n
    if sequences % shards:
        raise ConfigError(
            f"data.train_batch_size={cfg.data.train_batch_size} x rollout.n={cfg.rollout.n} = {sequences} sequences "
            f"do not split over {shards} batch shards (mesh.data x mesh.fsdp)"
        )
    if num_processes > 1 and cfg.data.train_batch_size % shards:
        raise ConfigError(
            f"data.train_batch_size={cfg.data.train_batch_size} prompts do not split over {shards} batch shards: with "
            f"{num_processes} processes every process must hold whole prompts"
        )
    forward = cfg.rollout.log_prob_micro_batch_size
    if forward is not None and (forward < 1 or (sequences // shards) % forward):
        raise ConfigError(
            f"rollout.log_prob_micro_batch_size={forward} must divide the {sequences // shards} sequences per batch shard"
        )
    for section in ("actor", "critic"):
        if section == "critic" and not cfg.use_critic:
            continue
        try:
            check_batch_sizes(engine_update_config(cfg, section), sequences, shards, section)
        except ValueError as error:
            raise ConfigError(_one_line(error)) from None
    return shape


def engine_update_config(cfg: TrainConfig, section: str):
    """The engine's view of ``actor``/``critic``: mini-batch sizes in sequences, C resolved, and a cosine decay
    without ``optim.decay_steps`` spread over the role's optimizer steps of the whole run."""
    update = getattr(cfg, section)
    optim = update.optim
    if optim.lr_schedule == "cosine" and optim.decay_steps == 0:
        optim = dataclasses.replace(optim, decay_steps=max(optimizer_steps(cfg, section) - optim.warmup_steps, 1))
    return dataclasses.replace(
        update,
        ppo_mini_batch_size=update.ppo_mini_batch_size * cfg.rollout.n,
        loss_scale_factor=float(update.loss_scale_factor or cfg.rollout.max_response_length),
        optim=optim,
    )


def optimizer_steps(cfg: TrainConfig, section: str) -> int:
    """How many optimizer steps ``actor``/``critic`` takes in the whole run: ``ppo_epochs`` passes over the
    mini-batches of every training step it updates in (the actor sits out ``trainer.critic_warmup`` steps)."""
    update = getattr(cfg, section)
    per_step = update.ppo_epochs * (cfg.data.train_batch_size // update.ppo_mini_batch_size)
    steps = cfg.trainer.total_steps - (cfg.trainer.critic_warmup if section == "actor" else 0)
    return per_step * max(steps, 0)
