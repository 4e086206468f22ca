"""The trainer's configuration: one typed schema, loaded from YAML plus ``key.sub=value`` overrides, validated once.

The schema is a tree of frozen dataclasses with verl's section and key names (``data``, ``model``, ``actor``,
``critic``, ``ref``, ``rollout``, ``reward``, ``algorithm``, ``mesh``, ``trainer``). OmegaConf merges the file and
the overrides onto it and checks keys and types; :func:`validate` then checks names against the registries and
batch sizes against each other. Every problem is a :class:`ConfigError` whose message is one line naming the key
and the value; the command-line entry points print it and exit with status 2, before anything is compiled.
"""

from __future__ import annotations

import dataclasses
import difflib
import pathlib
from typing import Any, Optional, Sequence

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from jppo.advantages import ADVANTAGE_ESTIMATORS
from jppo.data import BUILTIN_TASKS, DataConfig
from jppo.engine.config import ActorConfig, CriticConfig, NORMALIZATIONS
from jppo.losses import AGG_MODES, KL_KINDS, POLICY_LOSSES, required_agg_mode
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


def _reset_options_of_a_replaced_task(files: list, command_line) -> None:
    """A ``data.task`` given on the command line that differs from the file's starts from that task's own default
    options plus those given with it: the file's ``data.task_options`` belong to the file's task (a dotlist would
    otherwise merge them into the new task's, which rejects them)."""
    task = OmegaConf.select(command_line, "data.task", default=None)
    if task is None:
        return
    for layer in files:
        if OmegaConf.select(layer, "data.task", default=None) != task and OmegaConf.select(layer, "data.task_options",
                                                                                          default=None) is not None:
            del layer.data["task_options"]


def load_config(path: str | pathlib.Path | None, overrides: Sequence[str] = ()) -> TrainConfig:
    """The schema defaults, then the YAML file, then ``key.sub=value`` overrides; validated and frozen. Replacing
    ``data.task`` on the command line drops the file's ``data.task_options`` (see
    :func:`_reset_options_of_a_replaced_task`)."""
    schema = OmegaConf.structured(TrainConfig)
    layers = [schema]
    if path is not None:
        path = pathlib.Path(path)
        if not path.is_file():
            raise ConfigError(f"--config {str(path)!r}: no such file")
        try:
            layers.append(OmegaConf.load(path))
        except Exception as error:  # yaml errors come in several classes
            raise ConfigError(f"--config {str(path)!r}: not valid YAML ({_one_line(error)})") from None
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key.sub=value")
    try:
        command_line = OmegaConf.from_dotlist(list(overrides))
        _reset_options_of_a_replaced_task(layers[1:], command_line)
        layers.append(command_line)
        merged = OmegaConf.merge(*layers)
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


def validate(cfg: TrainConfig) -> None:
    """Names against the registries, sizes against each other; everything that can be checked before devices exist
    (the mesh against the device count is checked by :func:`check_mesh`)."""
    for key in ("data.train_files", "data.val_files"):
        value = getattr(cfg.data, key.split(".")[1])
        for item in (value or "").split(","):
            if item.strip() and not pathlib.Path(item.strip()).is_file():
                raise ConfigError(f"{key}={item.strip()!r}: no such file")
    if cfg.data.task == "files" and not cfg.data.train_files:
        raise ConfigError("data.train_files is required with data.task='files'")
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
    for section in ("actor", "critic"):
        update = getattr(cfg, section)
        _choice(f"{section}.loss_agg_mode", update.loss_agg_mode, AGG_MODES)
        _choice(f"{section}.normalization", update.normalization, NORMALIZATIONS)
        _choice(f"{section}.optim.name", update.optim.name, ["adamw", "sgd"])
        _choice(f"{section}.optim.lr_schedule", update.optim.lr_schedule, ["constant", "cosine"])
        for key in ("ppo_mini_batch_size", "ppo_micro_batch_size", "ppo_max_token_len", "ppo_epochs", "logprob_chunk_size"):
            _positive(f"{section}.{key}", getattr(update, key))
        _positive(f"{section}.optim.lr", update.optim.lr, allow_zero=True)
    _choice("actor.policy_loss", cfg.actor.policy_loss, sorted(POLICY_LOSSES))
    # Sequence-level losses (gspo, geo_mean) are means over sequences: the registry records the mode they need.
    needed = required_agg_mode(cfg.actor.policy_loss)
    if needed is not None and cfg.actor.loss_agg_mode != needed:
        raise ConfigError(
            f"actor.loss_agg_mode={cfg.actor.loss_agg_mode!r}: actor.policy_loss={cfg.actor.policy_loss!r} needs "
            f"actor.loss_agg_mode={needed!r}"
        )
    _choice("actor.kl_loss_type", cfg.actor.kl_loss_type, KL_KINDS)
    _choice("algorithm.adv_estimator", cfg.algorithm.adv_estimator, sorted(ADVANTAGE_ESTIMATORS))
    _choice("algorithm.kl_penalty", cfg.algorithm.kl_penalty, KL_KINDS)
    _choice("algorithm.kl_ctrl.type", cfg.algorithm.kl_ctrl.type, ["fixed", "adaptive"])
    if cfg.actor.policy_loss == "dro" and not cfg.actor.dro_beta:
        raise ConfigError(f"actor.dro_beta={cfg.actor.dro_beta!r}: policy_loss=dro needs a positive dro_beta")
    estimator = ADVANTAGE_ESTIMATORS[cfg.algorithm.adv_estimator]
    if estimator.needs_critic and cfg.critic.enable is False:
        raise ConfigError(f"critic.enable=False but algorithm.adv_estimator={cfg.algorithm.adv_estimator!r} needs a critic")
    if estimator.needs_group_ids and cfg.rollout.n < 2:
        raise ConfigError(
            f"rollout.n={cfg.rollout.n}: algorithm.adv_estimator={cfg.algorithm.adv_estimator!r} compares the "
            "responses of one prompt, so it needs rollout.n >= 2"
        )
    _positive("rollout.n", cfg.rollout.n)
    _positive("rollout.max_response_length", cfg.rollout.max_response_length)
    _positive("rollout.temperature", cfg.rollout.temperature)
    if not 0 < cfg.rollout.top_p <= 1:
        raise ConfigError(f"rollout.top_p={cfg.rollout.top_p!r} must be in (0, 1]")
    _positive("rollout.top_k", cfg.rollout.top_k, allow_zero=True)
    _positive("trainer.total_steps", cfg.trainer.total_steps)
    _positive("trainer.save_every", cfg.trainer.save_every, allow_zero=True)
    _positive("trainer.val_every", cfg.trainer.val_every, allow_zero=True)
    if cfg.trainer.resume not in ("auto", "never") and not pathlib.Path(cfg.trainer.resume).exists():
        raise ConfigError(f"trainer.resume={cfg.trainer.resume!r}: no such checkpoint directory")
    for key in ("critic.model_path", "ref.model_path", "reward.model_path"):
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value is not None and not (pathlib.Path(value) / "config.json").is_file():
            raise ConfigError(f"{key}={value!r}: no Hugging Face checkpoint (config.json) there")
    _check_batch_sizes(cfg)


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
    """The engine's view of ``actor``/``critic``: mini-batch sizes in sequences, C resolved."""
    update = getattr(cfg, section)
    return dataclasses.replace(
        update,
        ppo_mini_batch_size=update.ppo_mini_batch_size * cfg.rollout.n,
        loss_scale_factor=float(update.loss_scale_factor or cfg.rollout.max_response_length),
    )


