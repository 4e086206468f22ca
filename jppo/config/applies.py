"""Where each key of the configuration applies, and the refusal of a value the chosen rollout engine would ignore.

Every key of the schema changes what a run does, but not every key in every run: a critic's keys do nothing
without a critic, a policy loss's options only for the losses that take them, a rollout engine's keys only with
that engine. Three kinds of key, so that no setting silently does nothing:

- read by every run: no entry below;
- read only in some runs (an estimator, a loss, a mode, a sink): :data:`APPLIES` says where, and the configuration
  reference (``docs/configuration.md``, :mod:`jppo.config.reference`) prints it in its "applies to" column;
- read by one rollout engine only (:data:`ENGINE_KEYS`): a value other than the default with the other engine
  is refused by :func:`check_engine_keys` in one line naming the key, the value and what to set instead; so is
  ``ref.param_dtype`` where the reference is the LoRA policy's own frozen base, read in place.

An SFT run (``python -m jppo.sft``) reads the model, the actor's update settings, ``sft``, ``mesh``, ``trainer``
and what its validation samples and scores; the keys only an RL run reads (:data:`RL_ONLY`: the critic, the
reference, the estimator, the policy loss, training rollouts...) are refused in an SFT config when set
(:func:`check_sft_keys`), and the RL checks that tie them to the keys SFT shares are not run on it; an ``sft`` key
set in an RL config is refused too (:func:`check_rl_keys`).

This module reads the schema only (it is part of the config layer, which loads nothing but ``jppo.core``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jppo.config.schema import RolloutSection, TrainConfig
from jppo.core.errors import ConfigError

# advantage estimators that take each algorithm option (their functions' parameters gamma, lam, norm_by_std;
# tests/test_config_applies.py holds this to the registry)
ESTIMATOR_OPTIONS = {
    "algorithm.gamma": ("gae", "reinforce_plus_plus"),
    "algorithm.lam": ("gae",),
    "algorithm.norm_adv_by_std_in_grpo": ("grpo", "grpo_passk"),
}
# policy losses that read each option (jppo.losses.policy)
_CLIPPED = ("vanilla", "gspo", "geo_mean", "cispo", "dppo_tv", "dppo_kl")
POLICY_OPTIONS = {
    "actor.clip_ratio": _CLIPPED,
    "actor.clip_ratio_low": _CLIPPED,
    "actor.clip_ratio_high": _CLIPPED,
    "actor.clip_ratio_c": ("vanilla", "dppo_tv", "dppo_kl"),
    "actor.tau_pos": ("sapo",),
    "actor.tau_neg": ("sapo",),
    "actor.dro_beta": ("dro",),
}
_CRITIC = "a run with a critic (`critic.enable`, or an estimator that needs one: `gae`)"
_VALIDATION = "validation (`trainer.val_every`, `trainer.val_before_train`) and `jppo.eval`"
_GENERATED = "a generated task (built-in, `reasoning_gym:`), not `files`"

# the keys only a model with experts reads, and their defaults (a run without experts refuses another value,
# jppo.run.checks); first those that can leave a model of experts without any
EXPERT_KEYS = {
    "model.mlp_only_layers": (), "model.decoder_sparse_step": 1, "model.num_experts_per_tok": 1,
    "model.moe_intermediate_size": 0, "model.norm_topk_prob": False, "model.router_aux_loss_coef": 0.0,
    "actor.router_aux_loss_coef": None, "actor.router_z_loss_coef": 0.0,
    "critic.router_aux_loss_coef": None, "critic.router_z_loss_coef": 0.0, "model.expert_chunk_size": 0,
}
_EXPERTS = "a model with experts (`model.model_type: qwen3_moe`, or such a checkpoint; refused on a dense one)"

# key (or a section, ending in ".") -> where it is read, when not in every run; a key under a section entry is read
# where both say
APPLIES: dict[str, str] = {
    **{key: f"`algorithm.adv_estimator`: {', '.join(names)}" for key, names in ESTIMATOR_OPTIONS.items()},
    **{key: f"`actor.policy_loss`: {', '.join(names)}" for key, names in POLICY_OPTIONS.items()},
    "data.train_files": "`data.task: files`",
    "data.val_files": "`data.task: files`",
    "data.prompt_key": "`data.task: files`",
    "data.answer_key": "`data.task: files`",
    "data.num_train_examples": _GENERATED,
    "data.num_val_examples": _GENERATED,
    "data.seed": _GENERATED,
    "data.task_options": _GENERATED,
    "data.val_batch_size": _VALIDATION,
    "data.apply_chat_template_kwargs": "`data.apply_chat_template: true` (refused otherwise)",
    **{f"model.{name}": "a model without `model.path` (a checkpoint brings its own)" for name in (
        "model_type", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "rope_theta",
        "tie_word_embeddings", "max_position_embeddings", "initializer_range")},
    "model.attention_block_q": "`model.attention`: blockwise, pallas (and auto where it picks one of them)",
    "model.attention_block_kv": "`model.attention`: blockwise, pallas (and auto where it picks one of them)",
    **{f"{role}.{key}": text for role in ("actor", "critic") for key, text in {
        "ppo_micro_batch_size": f"`{role}.use_dynamic_bsz: false`",
        "ppo_max_token_len": f"`{role}.use_dynamic_bsz: true`",
        "loss_scale_factor": f"`{role}.loss_agg_mode: seq-mean-token-sum-norm`",
        **{f"optim.{name}": f"`{role}.optim.name: adamw`" for name in ("weight_decay", "beta1", "beta2", "eps")},
        "optim.decay_steps": f"`{role}.optim.lr_schedule: cosine`",
        "optim.min_lr_ratio": f"`{role}.optim.lr_schedule: cosine`",
        **{f"lora.{name}": f"`{role}.lora.rank` >= 1" for name in ("alpha", "target_modules", "dropout")},
    }.items()},
    **{key: _EXPERTS for key in EXPERT_KEYS},
    "actor.kl_loss_coef": "`actor.use_kl_loss: true`",
    "actor.kl_loss_type": "`actor.use_kl_loss: true`",
    "actor.rollout_correction.threshold": "`actor.rollout_correction.mode` other than none",
    "actor.routing_replay": "a model with experts sampled by `rollout.engine: jppo` in one turn (refused for a dense "
                           "model, with vllm and with `rollout.env`)",
    "critic.": _CRITIC,
    "ref.": "a KL term (`actor.use_kl_loss`, `algorithm.use_kl_in_reward`)",
    "ref.param_dtype": "a reference kept as a copy: `ref.model_path`, or a policy without LoRA (refused where the "
                       "reference is the LoRA policy's frozen base, read in place)",
    "rollout.top_k": "training rollouts (validation samples without top-k/top-p)",
    "rollout.top_p": "training rollouts (validation samples without top-k/top-p)",
    "rollout.val_n": _VALIDATION,
    "rollout.val_temperature": _VALIDATION,
    "rollout.log_prob_micro_batch_size": "forward passes of a role with `use_dynamic_bsz: false`",
    "rollout.max_turns": "`rollout.env` (multi-turn)",
    "rollout.max_num_seqs": "`rollout.engine: jppo` (refused with vllm: its own is `rollout.vllm.max_num_seqs`)",
    "rollout.cache_blocks": "`rollout.engine: jppo` (refused with vllm, which pages its own cache)",
    "rollout.vllm.": "`rollout.engine: vllm` (refused with jppo)",
    "rollout.devices": "the rollout on devices of its own: jppo's sampler on a mesh of its own (with P processes, "
                       "N / P per process), or with vllm N servers on GPUs of their own (`rollout.vllm.num_servers`)",
    "reward.function_style": "`reward.function` (refused without one)",
    "reward.gsm8k_flexible": "`reward.kind: gsm8k`",
    "reward.token_level": "a built-in task whose scorer gives per-position credit",
    "reward.overlong_buffer.len": "`reward.overlong_buffer.enable: true`",
    "reward.overlong_buffer.penalty_factor": "`reward.overlong_buffer.enable: true`",
    "algorithm.kl_penalty": "`algorithm.use_kl_in_reward: true`",
    "algorithm.kl_ctrl.": "`algorithm.use_kl_in_reward: true`",
    "algorithm.kl_ctrl.target_kl": "`algorithm.kl_ctrl.type: adaptive`",
    "algorithm.kl_ctrl.horizon": "`algorithm.kl_ctrl.type: adaptive`",
    "algorithm.filter_groups.metric": "`algorithm.filter_groups.enable: true`",
    "algorithm.filter_groups.max_num_gen_batches": "`algorithm.filter_groups.enable: true`",
    "trainer.project_name": "`wandb` in `trainer.logger`",
    "trainer.experiment_name": "`wandb` in `trainer.logger`",
    "trainer.progress_bar": "`console` in `trainer.logger`, on a terminal",
    "trainer.log_val_generations": "validation (`trainer.val_every`, `trainer.val_before_train`)",
    "trainer.critic_warmup": _CRITIC,
}

# keys (or sections, ending in ".") only an RL run reads: set in an SFT config they are refused, and the "applies to"
# column says so; value: what SFT reads instead, if anything
RL_ONLY: dict[str, str] = {
    **{key: "" for key in (
        "critic.", "ref.", "algorithm.", "data.prompt_key", "data.answer_key",
        "data.shuffle", "actor.ppo_epochs", "actor.shuffle", "actor.policy_loss", *POLICY_OPTIONS,
        "actor.entropy_coeff", "actor.use_kl_loss", "actor.kl_loss_coef", "actor.kl_loss_type", "actor.old_log_prob",
        "actor.routing_replay", "actor.rollout_correction.",
        "rollout.n", "rollout.temperature",
        "rollout.top_k", "rollout.top_p", "rollout.log_prob_micro_batch_size", "rollout.env", "rollout.max_turns",
        "rollout.engine", "rollout.vllm.", "rollout.devices", "reward.overlong_buffer.", "reward.token_level",
        "trainer.critic_warmup", "trainer.off_policy_steps", "trainer.deterministic")},
    "data.train_batch_size": "SFT's rows per step are sft.batch_size",
    "actor.ppo_mini_batch_size": "SFT's rows per step are sft.batch_size",
    "data.train_files": "SFT's rows are sft.train_files (or data.task's demonstrations)",
    "data.val_files": "SFT's held-out rows are sft.val_files",
}
_RL = "RL runs (`jppo.train`), not SFT (`jppo.sft`)"

# keys that only one rollout engine reads: key (or a section, ending in ".") -> that engine
ENGINE_KEYS = {"rollout.max_num_seqs": "jppo", "rollout.cache_blocks": "jppo", "rollout.vllm.": "vllm"}


def _matches(key: str, entries) -> list[str]:
    """The entries naming ``key`` or a section above it, outermost first."""
    return sorted((e for e in entries if key == e or (e.endswith(".") and key.startswith(e))), key=len)


def applies_to(key: str) -> str:
    """Where ``key`` is read: RL runs only (:data:`RL_ONLY`), ``sft.*`` by SFT only, then the entries of
    :data:`APPLIES` for it and the sections above it, outermost first; ``""`` for a key every run reads."""
    where = [_RL] if _matches(key, RL_ONLY) else ["`python -m jppo.sft`"] if key.startswith("sft.") else []
    return "; ".join(where + [APPLIES[entry] for entry in _matches(key, APPLIES)])


def check_sft_keys(cfg: TrainConfig) -> None:
    """In an SFT config, a key only RL runs read (:data:`RL_ONLY`) set to other than its default is refused in one
    line naming the key, the value and what SFT reads instead."""
    for section in dataclasses.fields(cfg):
        for key, value in _changed_leaves(getattr(cfg, section.name), f"{section.name}."):
            entries = _matches(key, RL_ONLY)
            if entries and (key, value) != ("critic.enable", False):  # false says what SFT does: no critic
                instead = RL_ONLY[entries[-1]] or "remove it"
                raise ConfigError(f"{key}={value!r} is read by RL runs only (python -m jppo.train); python -m "
                                  f"jppo.sft does not read it: {instead}")


def sets_sft(cfg: TrainConfig) -> bool:
    """Whether ``cfg`` is an SFT config: one that sets a key of the ``sft`` section to other than its default (what
    a command that takes either, ``jppo.plan`` or ``jppo.audit``, goes by; ``python -m jppo.sft`` takes any)."""
    return any(True for _ in _changed_leaves(cfg.sft, "sft."))


def check_rl_keys(cfg: TrainConfig) -> None:
    """In an RL config, an ``sft`` key set to other than its default is refused in one line: only
    ``python -m jppo.sft`` reads that section."""
    for key, value in _changed_leaves(cfg.sft, "sft."):
        raise ConfigError(f"{key}={value!r} is read by python -m jppo.sft only, and this config is checked as an RL "
                          "run's: run it with python -m jppo.sft, or remove it")


def _changed_leaves(section: Any, prefix: str):
    """``(key, value)`` of every leaf of ``section`` (nested sections included) set to other than its default."""
    for key, value in _changed(section, prefix):
        if dataclasses.is_dataclass(value):
            yield from _changed_leaves(value, key + ".")
        else:
            yield key, value


def _changed(section: Any, prefix: str):
    """``(key, value)`` of each field of ``section`` set to other than its default."""
    default = type(section)()
    for field in dataclasses.fields(section):
        value = getattr(section, field.name)
        if value != getattr(default, field.name):
            yield prefix + field.name, value


def check_engine_keys(cfg: TrainConfig) -> None:
    """A key the chosen ``rollout.engine`` does not read, set to other than its default, is refused in one line
    naming the key, the value and what to set instead; so is ``ref.param_dtype`` where nothing would be kept in it
    (a KL term whose reference is the LoRA policy's frozen base, read in place)."""
    engine = cfg.rollout.engine
    if engine == "vllm":
        value = cfg.rollout.max_num_seqs
        if value != RolloutSection.max_num_seqs:
            raise ConfigError(f"rollout.max_num_seqs={value!r} is jppo's sampler's; rollout.engine='vllm' does not "
                              f"read it: set rollout.vllm.max_num_seqs={value!r} instead")
        value = cfg.rollout.cache_blocks
        if str(value).strip() != RolloutSection.cache_blocks:
            raise ConfigError(f"rollout.cache_blocks={value!r} is jppo's sampler's response cache; "
                              "rollout.engine='vllm' does not read it (vLLM pages its own: "
                              "rollout.vllm.kv_cache_memory_bytes or rollout.vllm.gpu_memory_utilization): remove it")
    elif engine == "jppo":
        for key, value in _changed(cfg.rollout.vllm, "rollout.vllm."):
            instead = (f"jppo's sampler's is rollout.max_num_seqs={value!r}" if key == "rollout.vllm.max_num_seqs"
                       else "set rollout.engine=vllm, or remove it")
            raise ConfigError(f"{key}={value!r} is read only with rollout.engine=vllm and this run samples with "
                              f"jppo's sampler (rollout.engine='jppo'): {instead}")
    lora = cfg.actor.lora
    if cfg.ref.param_dtype is not None and cfg.use_reference and lora.rank >= 1 and cfg.ref.model_path is None:
        raise ConfigError(f"ref.param_dtype={cfg.ref.param_dtype!r} with actor.lora.rank={lora.rank}: the KL "
                          "reference is the LoRA policy's own frozen base, read in place (no copy to keep in another "
                          "dtype): remove ref.param_dtype, or set ref.model_path for a separate copy")
