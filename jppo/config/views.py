"""What a run's parts are given of its :class:`~jppo.config.TrainConfig`, derived once, in their own units.

This module is the one home of every translation from the config to a component's settings: the engine's update
configs (:func:`engine_view`), the sampler's parameters (:func:`sampling_params`) and the model it runs
(:func:`sampling_config`), the forward passes' micro-batching (:func:`forward_micro_batching`), the architecture of a
random or adapted model (:func:`random_model_config`, :func:`adapted_model_config`), what a config sets on a loaded
checkpoint (:func:`checkpoint_overrides`), the tokenizer's spec (:func:`tokenizer_spec`) and the KL controller
(:func:`kl_controller`). The builders and the validator both take them from here, so what is checked is what runs.

The config counts as its user writes (verl's convention): ``actor.ppo_mini_batch_size`` is a number of *prompts*,
``loss_scale_factor: null`` means the maximum response length, ``optim.decay_steps: 0`` means the rest of the run,
and ``optim.warmup_steps`` / ``optim.decay_steps`` count training steps.
The engine counts *sequences* (prompt + one response; ``rollout.n`` of them per prompt) and needs every constant
resolved. :func:`engine_view` is the one place that converts; the trainer, the audit and the validator's mesh
checks all take the engine's config from it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

from jppo.config.schema import TrainConfig
from jppo.core.errors import ConfigError, InvalidSetting
from jppo.core.settings import REJECTION_MODES
from jppo.engine.config import ActorConfig, CriticConfig
from jppo.models.config import ModelConfig
from jppo.models.hf import read_config
from jppo.rewards.kl_penalty import AdaptiveKLController, FixedKLController
from jppo.rollout.decode import SamplingParams
from jppo.rollout.sampler import RolloutEngineSpec

if TYPE_CHECKING:  # annotations only: the tokenizers come from jppo.data at run time
    from jppo.data import Tokenizer

ENGINE_CONFIGS = {"actor": ActorConfig, "critic": CriticConfig}


def rollout_sequences(cfg: TrainConfig) -> int:
    """Sequences of one training step: ``data.train_batch_size`` prompts x ``rollout.n`` responses each."""
    return cfg.data.train_batch_size * cfg.rollout.n


def sampled_batches(cfg: TrainConfig) -> list[tuple[int, int]]:
    """``(prompts, samples per prompt)`` of each batch the sampler is called on: the training batch and (when the
    run validates) the validation batch. A multi-turn rollout calls it on every row's own context (``n = 1``), so
    each row is a prompt."""
    batches = [(cfg.data.train_batch_size, cfg.rollout.n)]
    if cfg.trainer.val_every > 0 or cfg.trainer.val_before_train:
        batches.append((cfg.data.val_batch_size, cfg.rollout.val_n))
    if cfg.rollout.env is not None:
        batches = [(prompts * n, 1) for prompts, n in batches]
    return batches


def optimizer_steps_per_training_step(cfg: TrainConfig, role: str) -> int:
    """Optimizer steps ``role`` (``actor``/``critic``) takes in one training step: ``ppo_epochs`` passes over the
    mini-batches of the rollout batch."""
    section = getattr(cfg, role)
    return section.ppo_epochs * (cfg.data.train_batch_size // section.ppo_mini_batch_size)


def training_steps(cfg: TrainConfig, role: str) -> int:
    """Training steps in which ``role`` updates (the actor sits out the first ``trainer.critic_warmup``)."""
    return max(cfg.trainer.total_steps - (cfg.trainer.critic_warmup if role == "actor" else 0), 0)


def engine_view(cfg: TrainConfig, role: str) -> ActorConfig | CriticConfig:
    """The engine's config of ``role`` (``actor``/``critic``): the section's settings with ``ppo_mini_batch_size``
    in sequences (prompts x ``rollout.n``), ``loss_scale_factor`` resolved (C; the maximum response length unless
    given), the optimizer steps of one training step (the learning-rate schedule's unit), and a cosine decay
    without ``optim.decay_steps`` spread over the role's training steps after warm-up, reaching its floor on the
    last one. Micro-batch sizes (sequences per batch shard), token budgets, epochs and normalization count alike on both
    sides and are passed on as they are; with ``trainer.deterministic: bitwise`` a token budget becomes one sequence
    per micro-batch (the mode's passes hold one sequence, which the budget admits: ``_check_bitwise``)."""
    section = getattr(cfg, role)
    engine_config = ENGINE_CONFIGS[role]
    derived = {"ppo_mini_batch_size", "loss_scale_factor", "optim", "optimizer_steps_per_training_step", "old_log_prob",
               "bitwise"}
    same = {f.name: getattr(section, f.name) for f in dataclasses.fields(engine_config) if f.name not in derived}
    optim = section.optim
    if optim.lr_schedule == "cosine" and optim.decay_steps == 0:
        # warm-up takes training steps 0 .. W-1; the cosine runs from step W to its floor at the last step
        optim = dataclasses.replace(optim, decay_steps=max(training_steps(cfg, role) - optim.warmup_steps - 1, 1))
    if role == "actor":
        same["old_log_prob"] = old_log_prob_source(cfg)
    bitwise = cfg.trainer.deterministic == "bitwise"
    if bitwise and section.use_dynamic_bsz:  # one sequence per pass: within the budget, which every sequence fits
        same.update(use_dynamic_bsz=False, ppo_micro_batch_size=1)
    return engine_config(
        **same,
        ppo_mini_batch_size=section.ppo_mini_batch_size * cfg.rollout.n,
        loss_scale_factor=float(section.loss_scale_factor or cfg.rollout.max_response_length),
        optimizer_steps_per_training_step=optimizer_steps_per_training_step(cfg, role),
        optim=optim,
        bitwise=bitwise,
    )


OLD_LOG_PROB_CHOICES = ("auto", "recompute", "rollout")


def old_log_prob_source(cfg: TrainConfig) -> str:
    """Where the actor's PPO ratio takes its old log-probs (the engine's ``ActorConfig.old_log_prob``): ``recompute``
    or ``rollout`` as ``actor.old_log_prob`` says; ``auto`` gives ``update`` (no forward pass before the update, whose
    own stop-gradient log-probs are the same numbers) when the update is on-policy, every row updated once at the
    weights that sampled it (one epoch over one mini-batch: one optimizer step per training step), and nothing at
    collection reads the old log-probs before the update: no KL in the reward, no rejection
    (``actor.rollout_correction`` ``seq_rs`` / ``geo_rs``), no overlong filter (whose ``rollout/log_prob_abs_diff``
    counts the rows it then removes from the loss); otherwise ``recompute``. With ``trainer.off_policy_steps`` >= 1
    the rows were sampled by older weights, but the update's own first log-probs are still those of the weights it
    trains (the proximal policy the ratio is taken against), so the choice is the same."""
    choice = cfg.actor.old_log_prob
    if choice not in OLD_LOG_PROB_CHOICES:
        raise InvalidSetting("actor.", "old_log_prob", choice, f"one of {', '.join(OLD_LOG_PROB_CHOICES)}")
    if choice != "auto":
        return choice
    on_policy = optimizer_steps_per_training_step(cfg, "actor") == 1
    read_at_collection = (cfg.algorithm.use_kl_in_reward or cfg.algorithm.overlong_filter
                          or cfg.actor.rollout_correction.mode in REJECTION_MODES)
    return "update" if on_policy and not read_at_collection else "recompute"


def tokenizer_spec(cfg: TrainConfig) -> str:
    return cfg.model.tokenizer or cfg.model.path or f"builtin:{cfg.data.task}"


def random_model_config(cfg: TrainConfig, tokenizer: Optional[Tokenizer]) -> ModelConfig:
    """The architecture of a randomly initialised policy (no ``model.path``): the vocabulary is the tokenizer's.
    Without a tokenizer (checking the config before the vocabulary is loaded) the vocabulary is a placeholder."""
    m = cfg.model
    vocab = dict(vocab_size=1) if tokenizer is None else dict(
        vocab_size=tokenizer.vocab_size, bos_token_id=tokenizer.bos_id, eos_token_id=_eos_token_id(tokenizer),
        pad_token_id=tokenizer.pad_id,
    )
    return ModelConfig(**m.architecture(), **vocab)


def _eos_token_id(tokenizer: Tokenizer) -> int | tuple[int, ...]:
    """The model config's ``eos_token_id``: the one id, or every id when the tokenizer has several (as Hugging
    Face writes it), so an exported model stops on each of them."""
    return tokenizer.eos_ids[0] if len(tokenizer.eos_ids) == 1 else tuple(tokenizer.eos_ids)


# The model keys of a config that apply to a checkpoint's architecture too (jppo.config.ModelSection)
CHECKPOINT_OVERRIDES = ("dtype", "param_dtype", "remat", "attention", "attention_block_q", "attention_block_kv",
                        "layer_loop", "expert_chunk_size")


def checkpoint_overrides(cfg: TrainConfig) -> dict:
    """The jppo-only ModelConfig fields the config sets on every checkpoint it loads (policy, critic, reference)."""
    return {name: getattr(cfg.model, name) for name in CHECKPOINT_OVERRIDES}


def adapted_model_config(cfg: TrainConfig, role: str) -> ModelConfig:
    """The shape of the model ``role``'s adapters sit on: a checkpoint's ``config.json`` (``critic.model_path``
    for the critic, else ``model.path``; only the file is read), or the config's random model."""
    path = (cfg.critic.model_path if role == "critic" else None) or cfg.model.path
    return read_config(path) if path else random_model_config(cfg, None)


def sampling_config(cfg: TrainConfig, config: ModelConfig) -> ModelConfig:
    """The policy's architecture ``config`` as the sampler runs it: computing (and caching keys and values) in
    ``rollout.dtype``, by default the policy's own compute dtype."""
    return dataclasses.replace(config, dtype=cfg.rollout.dtype or config.dtype)


def rollout_engine_spec(cfg: TrainConfig, policy) -> RolloutEngineSpec:
    """What ``rollout.engine`` starts with: the policy's architecture as the sampler runs it, the longest context
    a request reaches (``data.max_prompt_length + rollout.max_response_length``; with ``rollout.env`` a turn's
    context already holds up to ``max_response_length`` tokens of earlier turns and observations, and samples that
    many more), ``trainer.seed``, the engine's options (``rollout.<engine>``, when the schema has them) and the
    ``policy`` module itself."""
    turns = 2 if cfg.rollout.env is not None else 1
    context = cfg.data.max_prompt_length + turns * cfg.rollout.max_response_length
    options = getattr(cfg.rollout, cfg.rollout.engine, None)
    model = None if policy is None else sampling_config(cfg, policy.config)
    return RolloutEngineSpec(model, context, cfg.trainer.seed, options, policy)


# the keys of RolloutEngineSpec.max_model_len, for messages
CONTEXT_KEYS = "data.max_prompt_length + rollout.max_response_length (x 2 with rollout.env)"
def reference_param_dtype(cfg: TrainConfig) -> str:
    """The dtype the KL reference's weights are kept in: ``ref.param_dtype``, by default the compute dtype."""
    return cfg.ref.param_dtype or cfg.model.dtype


# The sampler's settings (SamplingParams fields) and the config keys that give them, per use.
SAMPLING_KEYS = {
    "training": {"n": "rollout.n", "temperature": "rollout.temperature", "top_k": "rollout.top_k",
                 "top_p": "rollout.top_p", "max_new_tokens": "rollout.max_response_length",
                 "max_num_seqs": "rollout.max_num_seqs", "cache_blocks": "rollout.cache_blocks"},
    "evaluation": {"n": "rollout.val_n", "temperature": "rollout.val_temperature",
                   "max_new_tokens": "rollout.max_response_length", "max_num_seqs": "rollout.max_num_seqs",
                   "cache_blocks": "rollout.cache_blocks"},
}


def cache_blocks(value: str) -> int:
    """``rollout.cache_blocks`` as :attr:`SamplingParams.cache_blocks`: ``auto`` is 0 (chosen by backend), a
    positive integer itself."""
    text = str(value).strip()
    if text == "auto" or (text.isdigit() and int(text) >= 1):
        return 0 if text == "auto" else int(text)
    raise ConfigError(f"rollout.cache_blocks={value!r} is invalid: it must be auto or an integer >= 1")


def sampling_params(
    cfg: TrainConfig, tokenizer: Optional[Tokenizer], *, evaluation: bool = False, greedy_baseline: bool = False
) -> SamplingParams:
    """How the trainer samples: training rollouts (``rollout.*``), held-out evaluation (``rollout.val_*``) or the one
    greedy response per prompt whose reward is ReMax's baseline. Without a tokenizer (checking the config before
    the vocabulary is loaded) there is no EOS and padding is token 0."""
    eos = tuple(tokenizer.eos_ids) if tokenizer is not None else ()  # every id that ends a response
    tokens = dict(eos_token_ids=eos, pad_token_id=0 if tokenizer is None else tokenizer.pad_id,
                  max_num_seqs=cfg.rollout.max_num_seqs, cache_blocks=cache_blocks(cfg.rollout.cache_blocks),
                  bitwise=cfg.trainer.deterministic == "bitwise")
    if greedy_baseline:
        return SamplingParams(max_new_tokens=cfg.rollout.max_response_length, greedy=True, n=1, **tokens)
    if evaluation:
        greedy = cfg.rollout.val_temperature <= 0
        return SamplingParams(
            max_new_tokens=cfg.rollout.max_response_length, temperature=1.0 if greedy else cfg.rollout.val_temperature,
            greedy=greedy, n=cfg.rollout.val_n, **tokens,
        )
    return SamplingParams(
        max_new_tokens=cfg.rollout.max_response_length, temperature=cfg.rollout.temperature, top_k=cfg.rollout.top_k,
        top_p=cfg.rollout.top_p, n=cfg.rollout.n, record_routing=cfg.actor.routing_replay == "rollout", **tokens,
    )


def forward_micro_batching(cfg: TrainConfig, role: str) -> dict:
    """How forward passes (log-probs, values, reward scores) cut the rollout batch: like ``role``'s updates,
    or ``rollout.log_prob_micro_batch_size`` sequences per shard when set; one sequence per shard with
    ``trainer.deterministic: bitwise``."""
    update = getattr(cfg, role)
    if cfg.trainer.deterministic == "bitwise":  # a row's outputs then have the same bits in any cut (one row a pass)
        return {"micro_batch_size": 1, "bitwise": True}
    if update.use_dynamic_bsz:
        return {"max_token_len": update.ppo_max_token_len}
    return {"micro_batch_size": cfg.rollout.log_prob_micro_batch_size or update.ppo_micro_batch_size}


def kl_controller(cfg: TrainConfig):
    ctrl = cfg.algorithm.kl_ctrl
    if ctrl.type == "adaptive":
        return AdaptiveKLController(init_kl_coef=ctrl.kl_coef, target_kl=ctrl.target_kl, horizon=ctrl.horizon)
    return FixedKLController(kl_coef=ctrl.kl_coef)
