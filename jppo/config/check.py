"""The trainer's config validator: every value of a :class:`~jppo.config.TrainConfig` checked before anything is
built or compiled, each problem a :class:`~jppo.core.errors.ConfigError` of one line naming the key and the value as
the user wrote them.

:func:`check` (run by :func:`jppo.config.load_config`) checks what the config alone decides (numbers against the
ranges only the trainer gives them, keys against each other, files and folders, and the keys an engine or mode
does not read: :mod:`jppo.config.applies`), then runs every check a component registered
(:data:`jppo.core.checks.CONFIG_CHECKS`): names against the registries, and every setting against the limits of
the component that uses it, stated once, in that component (:mod:`jppo.run.checks`). This module imports
the config layer and ``jppo.core`` only; the commands load the components' checks before they read a config.
Batch sizes against a mesh's batch shards: :func:`jppo.config.devices.check_mesh`.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
from typing import Any

from jppo.config.applies import check_engine_keys, check_rl_keys, check_sft_keys
from jppo.config.schema import MAX_OFF_POLICY_STEPS, TrainConfig
from jppo.core.checks import as_key, check_local_dir, choice, positive, run_config_checks, within
from jppo.core.errors import ConfigError
from jppo.core.inputs import file_list
from jppo.core.paths import is_remote, missing_backend

# Parameter dtypes too coarse to train in: an Adam step moves a weight by about lr (1e-6 for a fine-tune) while a
# weight of ~0.02 is stored with a spacing of ~1e-4 in bfloat16 (~1e-5 in float16), so the update rounds away.
HALF_PRECISION = ("bfloat16", "float16")


def _leaves(node: Any, prefix: str = ""):
    """``(dotted key, value)`` of every leaf of a config dataclass tree."""
    for field in dataclasses.fields(node):
        value = getattr(node, field.name)
        if dataclasses.is_dataclass(value):
            yield from _leaves(value, f"{prefix}{field.name}.")
        else:
            yield f"{prefix}{field.name}", value


def check(cfg: TrainConfig, data_files: bool = True, sft: bool = False) -> None:
    """What the config alone decides, then every registered component check (the sampler's, the policy loss's,
    the optimizer's, the model's, ...), so a value a component would refuse at run time is refused here, before
    anything compiles. The mesh against the device count is checked by :func:`check_mesh`; files and plug-ins are
    read by :func:`jppo.run.build.load_inputs`. ``data_files`` False: the prompt files need not exist (what needs
    only shapes: compiling for a target). ``sft``: an SFT config (``python -m jppo.sft``): a key only RL runs read
    is refused when set (:func:`~jppo.config.applies.check_sft_keys`), and the checks of what only RL runs read
    are left out; else an ``sft`` key set is refused (:func:`~jppo.config.applies.check_rl_keys`)."""
    for key, value in _leaves(cfg):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}={value!r} must be a finite number")
    (check_sft_keys if sft else check_rl_keys)(cfg)
    _check_sources(cfg, data_files, sft)
    _check_reward(cfg)
    _check_trained_param_dtype(cfg.model.param_dtype)
    for section in ("actor", "critic"):
        with as_key({}, prefix=f"{section}.lora."):
            getattr(cfg, section).lora.check()
    _check_numbers(cfg)
    _check_trainer(cfg)
    _check_sft(cfg, data_files)
    _check_off_policy(cfg)
    check_engine_keys(cfg)
    run_config_checks(cfg, sft)


def _check_sources(cfg: TrainConfig, data_files: bool = True, sft: bool = False) -> None:
    for key in ("data.train_files", "data.val_files") if data_files else ():
        for item in file_list(getattr(cfg.data, key.split(".")[1]), key):
            if not pathlib.Path(item).is_file():
                raise ConfigError(f"{key}={item!r}: no such file")
    if cfg.data.task == "files" and not cfg.data.val_files and not sft:  # SFT's held-out rows: sft.val_files
        for key, value in (("trainer.val_every", cfg.trainer.val_every),
                           ("trainer.val_before_train", cfg.trainer.val_before_train)):
            if value:
                raise ConfigError(f"{key}={value!r} needs held-out prompts: with data.task='files' set "
                                  "data.val_files (or turn validation off)")
    for key in ("model.path", "critic.model_path", "ref.model_path", "reward.model_path"):
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value is not None and not (pathlib.Path(value) / "config.json").is_file():
            raise ConfigError(f"{key}={value!r}: no Hugging Face checkpoint (config.json) there")


def _check_reward(cfg: TrainConfig) -> None:
    """The overlong buffer fits in the length limit (the reward kind's own check: :mod:`jppo.rewards.reward_fn`)."""
    buffer, limit = cfg.reward.overlong_buffer, cfg.rollout.max_response_length
    if buffer.enable and not 1 <= buffer.len < limit:
        raise ConfigError(f"reward.overlong_buffer.len={buffer.len!r} must be >= 1 and < "
                          f"rollout.max_response_length={limit}")
    if buffer.enable:
        positive("reward.overlong_buffer.penalty_factor", buffer.penalty_factor, allow_zero=True)


def _check_trained_param_dtype(param_dtype: str) -> None:
    """``model.param_dtype`` is the dtype of every trained model's weights (the actor's, and the critic's, which is
    built from the same section); mixed precision keeps them in float32 and computes in ``model.dtype``."""
    if param_dtype in HALF_PRECISION:
        raise ConfigError(f"model.param_dtype={param_dtype!r}: trained weights (actor, critic) in {param_dtype} lose "
                          "Adam's small updates to rounding; use float32 master weights with model.dtype: bfloat16 "
                          "(mixed precision)")


def _check_numbers(cfg: TrainConfig) -> None:
    """Ranges only the trainer gives its numbers (the components' own ranges are theirs)."""
    algorithm = cfg.algorithm
    positive("actor.kl_loss_coef", cfg.actor.kl_loss_coef, allow_zero=True)
    for role in ("actor", "critic"):
        update = getattr(cfg, role)
        if update.router_aux_loss_coef is not None:
            positive(f"{role}.router_aux_loss_coef", update.router_aux_loss_coef, allow_zero=True)
        positive(f"{role}.router_z_loss_coef", update.router_z_loss_coef, allow_zero=True)
    positive("critic.cliprange_value", cfg.critic.cliprange_value, allow_zero=True)
    within("algorithm.gamma", algorithm.gamma, 0.0, 1.0)
    within("algorithm.lam", algorithm.lam, 0.0, 1.0)
    positive("algorithm.kl_ctrl.kl_coef", algorithm.kl_ctrl.kl_coef, allow_zero=True)
    positive("algorithm.filter_groups.max_num_gen_batches", algorithm.filter_groups.max_num_gen_batches,
             allow_zero=True)
    positive("rollout.prompt_bucket", cfg.rollout.prompt_bucket)
    positive("rollout.max_turns", cfg.rollout.max_turns)
    positive("rollout.devices", cfg.rollout.devices, allow_zero=True)


def _check_output_dir(output_dir: str) -> None:
    """The run's directory must be one the trainer can create or write into (nothing is created here)."""
    if not output_dir.strip():
        raise ConfigError(f"trainer.output_dir={output_dir!r} must name a directory")
    if is_remote(output_dir):  # a cloud URI: written through epath; whether the bucket exists is seen at run time
        problem = missing_backend(output_dir)
        if problem:
            raise ConfigError(f"trainer.output_dir={output_dir!r}: {problem}")
        return
    check_local_dir("trainer.output_dir", output_dir)


def _check_trainer(cfg: TrainConfig) -> None:
    trainer = cfg.trainer
    positive("trainer.total_steps", trainer.total_steps)
    positive("trainer.save_every", trainer.save_every, allow_zero=True)
    positive("trainer.val_every", trainer.val_every, allow_zero=True)
    positive("trainer.max_checkpoints_to_keep", trainer.max_checkpoints_to_keep)
    positive("trainer.critic_warmup", trainer.critic_warmup, allow_zero=True)
    if not 0 <= trainer.seed < 2**32:
        raise ConfigError(f"trainer.seed={trainer.seed!r} must be in [0, 2**32)")
    _check_output_dir(trainer.output_dir)
    positive("trainer.log_val_generations", trainer.log_val_generations, allow_zero=True)
    _check_bitwise(cfg)


DETERMINISTIC = ("off", "bitwise")
OFF_SPELLINGS = ("off", "false", "no", "none", "null")


def _check_bitwise(cfg: TrainConfig) -> None:
    """``trainer.deterministic``: off or bitwise; bitwise runs one sequence per pass (a token budget must admit the
    longest), and needs the global normalization, jppo's sampler without continuous batching and no routing replay
    (what it needs of the mesh: :func:`jppo.config.devices.check_bitwise_mesh`)."""
    value = str(cfg.trainer.deterministic)
    if value.strip().lower() in OFF_SPELLINGS:  # YAML reads an unquoted off / no / false as a boolean
        return
    choice("trainer.deterministic", value, DETERMINISTIC)
    if value != "bitwise":
        return
    if cfg.rollout.engine != "jppo" or cfg.rollout.max_num_seqs:
        key, value = ("rollout.engine", cfg.rollout.engine) if cfg.rollout.engine != "jppo" else (
            "rollout.max_num_seqs", cfg.rollout.max_num_seqs)
        raise ConfigError(f"{key}={value!r} with trainer.deterministic='bitwise': the mode samples with jppo's "
                          "sampler, each prompt alone (rollout.engine: jppo, rollout.max_num_seqs: 0)")
    if cfg.actor.routing_replay != "none":  # the bitwise sampler routes each token as the trainer does
        raise ConfigError(f"actor.routing_replay={cfg.actor.routing_replay!r} with trainer.deterministic='bitwise': "
                          "the mode's sampler routes every token as the trainer does, nothing to replay (use none)")
    for role in cfg.roles:
        section = getattr(cfg, role)
        longest = cfg.data.max_prompt_length + cfg.rollout.max_response_length
        if section.use_dynamic_bsz and section.ppo_max_token_len < longest:
            raise ConfigError(f"{role}.ppo_max_token_len={section.ppo_max_token_len} with trainer.deterministic="
                              f"'bitwise': the mode's passes hold one sequence, of up to {longest} tokens "
                              "(data.max_prompt_length + rollout.max_response_length)")
        if section.normalization != "global":
            raise ConfigError(f"{role}.normalization={section.normalization!r} with trainer.deterministic='bitwise' "
                              "(global only)")


def _check_sft(cfg: TrainConfig, data_files: bool = True) -> None:
    """The ``sft`` section (read by ``python -m jppo.sft`` only): sizes, and its files where they are read."""
    positive("sft.max_length", cfg.sft.max_length)
    positive("sft.batch_size", cfg.sft.batch_size)
    for key in ("sft.train_files", "sft.val_files"):
        for item in file_list(getattr(cfg.sft, key.split(".")[1]), key):
            if data_files and not pathlib.Path(item).is_file():
                raise ConfigError(f"{key}={item!r}: no such file")


def _check_off_policy(cfg: TrainConfig) -> None:
    """``trainer.off_policy_steps`` in range, and nothing that needs the batch sampled by the weights it trains."""
    k = cfg.trainer.off_policy_steps  # an integer: the typed schema refuses anything else when it loads
    key = f"trainer.off_policy_steps={k!r}"
    within("trainer.off_policy_steps", k, 0, MAX_OFF_POLICY_STEPS)
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
