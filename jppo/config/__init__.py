"""The trainer's configuration: one typed schema, loaded from YAML plus ``key.sub=value`` overrides.

The schema is a tree of frozen dataclasses with verl's section and key names (``data``, ``model``, ``actor``,
``critic``, ``ref``, ``rollout``, ``reward``, ``algorithm``, ``mesh``, ``trainer``); the values are in the units a
user writes (``ppo_mini_batch_size`` counts prompts). OmegaConf merges the file and the overrides onto it and
checks keys and types; :func:`jppo.config.check.validate` then checks every value, and :func:`jppo.config.views.engine_view`
derives what the engine is given, in its own units. Every problem is a :class:`~jppo.core.errors.ConfigError` (one
line naming the key and the value); the command-line entry points print it and exit with status 2, before anything
is compiled.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Any, Optional, Sequence

from etils import epath
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from jppo.advantages import ADVANTAGE_ESTIMATORS
from jppo.data import DataConfig
from jppo.engine.config import ActorSettings, CriticSettings
from jppo.core.errors import ConfigError, one_line
from jppo.models.config import model_settings
from jppo.models.lora import LoRAConfig
from jppo.rewards import RewardConfig
from jppo.config.check import check_mesh, resolve_sources, validate

# ConfigError (jppo.core.errors) and check_mesh (jppo.config.check) are re-exported: callers import them from here too.
__all__ = ["ConfigError", "TrainConfig", "check_mesh", "load_config", "save_config", "to_dict"]

# The --config help of every command line (train, eval, plan): what runs without a file.
CONFIG_HELP = (
    "YAML config. Without one the run uses the config schema's defaults (jppo/config/__init__.py): verl-style "
    "hyper-parameters (e.g. actor.optim.lr=1e-6) on the built-in reverse_digits task with a tiny random model. "
    "They are not the quickstart, which is --config configs/quickstart.yaml"
)

# The ModelConfig fields a config gives for a model initialised at random, with the defaults of a small test model
# (their types and meaning are ModelConfig's; a checkpoint brings its own shape).
RANDOM_MODEL = dict(
    model_type="qwen2", hidden_size=64, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=None,
    rope_theta=10000.0, tie_word_embeddings=True, max_position_embeddings=512, dtype="float32",
    param_dtype="float32", remat=False, initializer_range=0.02, attention="reference",
    layer_loop="auto",
)


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Where the policy and its vocabulary come from (see :class:`ModelSection`)."""

    path: Optional[str] = None
    tokenizer: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class ModelSection(model_settings(RANDOM_MODEL), ModelSource):
    """The policy. ``path``: a local Hugging Face checkpoint directory; without it a model of the shape given by
    the other keys (:data:`RANDOM_MODEL`) is initialised at random (``trainer.seed``); ``dtype`` (compute),
    ``param_dtype`` (stored weights), ``remat``, ``attention`` and ``layer_loop`` apply to a checkpoint too, and to the critic built from it. Mixed precision is
    ``param_dtype: float32`` with ``dtype: bfloat16``; half-precision weights are refused, as Adam's updates would
    round away. ``tokenizer``: a directory holding ``tokenizer.json`` (default:
    ``path``), or ``builtin:<task>`` for a built-in task's character vocabulary (the default without ``path``)."""


@dataclasses.dataclass(frozen=True)
class UpdateSection:
    """What a config section of an update counts in the user's units (the engine's: ``UpdateConfig``)."""

    ppo_mini_batch_size: int = 8  # PROMPTS per optimizer step (verl's convention); the engine gets x rollout.n


@dataclasses.dataclass(frozen=True)
class ActorSection(ActorSettings, UpdateSection):
    """The policy update (:class:`~jppo.engine.config.ActorSettings`). ``lora``: train low-rank adapters on the
    policy's projections instead of all its weights (:class:`~jppo.models.lora.LoRAConfig`; ``rank: 0``, the
    default, trains everything)."""

    lora: LoRAConfig = dataclasses.field(default_factory=LoRAConfig)


@dataclasses.dataclass(frozen=True)
class CriticSection(CriticSettings, UpdateSection):
    """The critic: a value head on the policy's backbone (initialised from the policy checkpoint, as verl does).
    ``enable: null`` builds it only when ``algorithm.adv_estimator`` needs one (gae)."""

    enable: Optional[bool] = None
    model_path: Optional[str] = None
    lora: LoRAConfig = dataclasses.field(default_factory=LoRAConfig)  # adapters on the critic's backbone, new head trained


@dataclasses.dataclass(frozen=True)
class RefSection:
    """The reference policy for KL terms, kept only when a KL term needs it. ``model_path`` defaults to the
    policy's initial weights."""

    model_path: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class RolloutSection:
    """Sampling with the KV-cache sampler. ``n`` responses per prompt; validation samples ``val_n`` per prompt
    at ``val_temperature`` (0: greedy). Prompt lengths are padded up to a multiple of ``prompt_bucket`` tokens so
    the sampler compiles once per bucket. ``dtype`` is the sampler's compute dtype (default: ``model.dtype``);
    ``bfloat16`` sampling against float32 training is the rollout/trainer mismatch that
    ``actor.rollout_correction`` corrects and its ``rollout_corr/*`` metrics show.

    ``max_num_seqs``: rows the sampler decodes at once (0: all of a batch). Fewer rows than the batch turns on
    continuous batching: a row that ends hands its slot to the next waiting row, so no decoding step is spent on
    finished rows (responses with a long tail of lengths), at a cost in parallelism per step; each row's tokens
    are the same either way (:mod:`jppo.rollout.decode`).

    ``env``: a multi-turn environment (``builtin:calculator``, ``path/to/file.py:make_env`` or
    ``package.module:make_env``, see :mod:`jppo.rollout.env`); each response then alternates up to ``max_turns``
    model turns with the environment's observations, which are attended but masked out of every loss."""

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_response_length: int = 16
    prompt_bucket: int = 16
    val_n: int = 1
    val_temperature: float = 0.0
    log_prob_micro_batch_size: Optional[int] = None  # sequences per shard in forward passes; default: actor's
    dtype: Optional[str] = None  # the sampler's compute dtype; default: model.dtype
    env: Optional[str] = None  # multi-turn environment factory; None: single-turn
    max_turns: int = 4  # model turns per response with an env
    max_num_seqs: int = 0  # rows decoded at once; 0: every row of the batch (continuous batching below that)


@dataclasses.dataclass(frozen=True)
class KLControlSection:
    type: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: int = 10000


@dataclasses.dataclass(frozen=True)
class FilterGroupsSection:
    """DAPO's dynamic sampling (:mod:`jppo.run.dynamic_sampling`): prompt groups whose ``rollout.n`` responses all
    have the same ``metric`` (``reward``: the training reward, overlong shaping included; ``score``: without it)
    are dropped, and prompt batches are sampled until ``data.train_batch_size`` prompts are kept. More than
    ``max_num_gen_batches`` batches in one step (0: no limit) stops the run with an error, as verl does."""

    enable: bool = False
    metric: str = "reward"
    max_num_gen_batches: int = 0


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
    # DAPO's overlong filtering: responses cut by rollout.max_response_length before they ended are masked out of
    # the update's losses (they still count in their group's advantage baseline); the normalizers then count the
    # kept tokens only. A multi-turn episode ended by the environment or by rollout.max_turns is not cut.
    overlong_filter: bool = False
    filter_groups: FilterGroupsSection = dataclasses.field(default_factory=FilterGroupsSection)


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
    global step 0, and is not repeated when a run resumes.

    ``logger``: where metrics go (:data:`jppo.runlog.SINKS`: console, jsonl, tensorboard, wandb); ``wandb`` needs the
    optional package and names its run ``project_name`` / ``experiment_name`` (default: the output directory's
    name). ``progress_bar``: on a terminal, the console shows a bar rather than summary lines. At each validation,
    the first ``log_val_generations`` responses (prompt, response, reward, finished) are logged too."""

    total_steps: int = 100
    output_dir: str = "runs/default"
    seed: int = 0
    save_every: int = 0  # 0: only at the end
    resume: str = "auto"  # auto | never | PATH
    max_checkpoints_to_keep: int = 2
    val_every: int = 0  # 0: no validation
    val_before_train: bool = False
    export_hf: bool = False
    logger: list[str] = dataclasses.field(default_factory=lambda: ["console", "jsonl", "tensorboard"])
    project_name: str = "jppo"
    experiment_name: Optional[str] = None
    log_val_generations: int = 16
    progress_bar: bool = True
    plots: bool = True
    critic_warmup: int = 0  # steps that train only the critic
    # auto | off (also none, null) | an absolute FOLDER: the persistent XLA cache (jppo.run.compile_cache)
    compilation_cache: Optional[str] = "auto"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    actor: ActorSection = dataclasses.field(default_factory=ActorSection)
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
    def roles(self) -> tuple[str, ...]:
        """The sections whose models the run updates."""
        return ("actor", "critic") if self.use_critic else ("actor",)


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
        raise ConfigError(f"{where} is invalid: {one_line(error)}") from None


def _override_layer(item: str):
    """One ``key.sub=value`` override as a config layer; the value is parsed as YAML (a number, a list, ...)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form key.sub=value")
    try:
        return OmegaConf.from_dotlist([item])
    except Exception as error:  # yaml's parser errors are not ValueErrors
        raise ConfigError(f"override {item!r} is not valid YAML ({one_line(error)})") from None


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
            raise ConfigError(f"--config {str(path)!r}: not valid YAML ({one_line(error)})") from None
        _reset_options_of_a_replaced_task(layer, [override for override, _ in layers])
        merged = _merged(merged, layer, f"--config {str(path)!r}")
    for layer, item in layers:
        merged = _merged(merged, layer, f"override {item!r}")
    try:
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as error:
        raise ConfigError(_omegaconf_message(error)) from None
    except ValueError as error:  # a section's own check (its message names the key)
        raise ConfigError(one_line(error)) from None
    cfg = resolve_sources(cfg)  # Hugging Face repo ids -> cached snapshot directories
    validate(cfg)
    return cfg


def to_dict(cfg: TrainConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def save_config(cfg: TrainConfig, path: str | os.PathLike) -> None:
    """The resolved configuration as YAML (what the run actually used)."""
    epath.Path(path).write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
