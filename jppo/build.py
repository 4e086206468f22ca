"""What a training run is built from, made from its configuration: vocabulary, data, rewards, models, sampling.

Everything that can fail on user input (a missing file, a bad task option, a checkpoint without a tensor) fails
here, before anything is compiled, with a one-line message.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jppo.config import ConfigError, TrainConfig
from jppo.data import PromptDataset, Tokenizer, load_dataset, load_tokenizer, task_of
from jppo.models import CausalLM, ModelConfig, ValueModel, create_model, load_pretrained
from jppo.models.lora import LoRAConfig, attach_lora, trainable_filter
from jppo.rewards import CreditFn, RewardFn, build_credit_fn, build_reward_fn
from jppo.rollout import SamplingParams
from jppo.rollout.env import EnvFactory, load_env, stop_token_ids


@dataclasses.dataclass
class RunInputs:
    """What a run reads from outside: vocabulary, prompts and the reward function."""

    tokenizer: Tokenizer
    train_data: PromptDataset
    val_data: Optional[PromptDataset]
    reward_fn: RewardFn
    credit_fn: Optional[CreditFn] = None
    env_factory: Optional[EnvFactory] = None  # rollout.env: one environment per response
    stop_ids: tuple[int, ...] = ()  # tokens that end a model turn besides EOS (the env's stop texts)


def tokenizer_spec(cfg: TrainConfig) -> str:
    return cfg.model.tokenizer or cfg.model.path or f"builtin:{cfg.data.task}"


def load_inputs(cfg: TrainConfig, validation: bool = False) -> RunInputs:
    """Vocabulary, prompts and rewards of the run; the held-out prompts when the run validates (or ``validation``,
    for an evaluation). What they refuse (a missing file, a task option, a prompt over
    ``data.max_prompt_length``, a plug-in that does not load) is a :class:`ConfigError` in one line."""
    try:
        tokenizer = load_tokenizer(tokenizer_spec(cfg))
        train = load_dataset(cfg.data, tokenizer, "train")
        has_val = validation or cfg.trainer.val_every > 0 or cfg.trainer.val_before_train
        val = load_dataset(cfg.data, tokenizer, "val") if has_val else None
        task = task_of(cfg.data)
        env = load_env(cfg.rollout.env) if cfg.rollout.env is not None else None
        stop_ids = stop_token_ids(env, tokenizer, cfg.rollout.env) if env is not None else ()
        return RunInputs(
            tokenizer, train, val, build_reward_fn(cfg.reward, task), build_credit_fn(cfg.reward, task), env, stop_ids
        )
    except (ValueError, KeyError, FileNotFoundError) as error:
        text = error.args[0] if isinstance(error, KeyError) and error.args else str(error)  # KeyError quotes its text
        raise ConfigError(" ".join(str(text).split())) from None


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
CHECKPOINT_OVERRIDES = ("dtype", "param_dtype", "remat", "attention", "layer_loop")


def checkpoint_overrides(cfg: TrainConfig) -> dict:
    """The jppo-only ModelConfig fields the config sets on every checkpoint it loads (policy, critic, reference)."""
    return {name: getattr(cfg.model, name) for name in CHECKPOINT_OVERRIDES}


def build_policy(cfg: TrainConfig, tokenizer: Tokenizer, mesh: Mesh) -> CausalLM:
    if cfg.model.path:
        return load_pretrained(cfg.model.path, mesh=mesh, **checkpoint_overrides(cfg))
    return create_model(CausalLM, random_model_config(cfg, tokenizer), mesh, seed=cfg.trainer.seed)


def sampling_config(cfg: TrainConfig, config: ModelConfig) -> ModelConfig:
    """The policy's architecture ``config`` as the sampler runs it: computing (and caching keys and values) in
    ``rollout.dtype``, by default the policy's own compute dtype."""
    return dataclasses.replace(config, dtype=cfg.rollout.dtype or config.dtype)


def sampling_graphdef(cfg: TrainConfig, policy: CausalLM) -> nnx.GraphDef:
    """The structure the sampler runs the policy's parameters with: the policy's, computing in ``rollout.dtype``
    (same parameters, same layout; only the compute dtype, a static attribute, differs)."""
    config = sampling_config(cfg, policy.config)

    def structure():
        model = type(policy)(config, rngs=nnx.Rngs(0))
        return attach_lora(model, cfg.actor.lora, 0) if has_adapters(policy) else model  # the adapters too

    return nnx.split(nnx.eval_shape(structure), nnx.Param)[0]


def build_critic(cfg: TrainConfig, policy: CausalLM, mesh: Mesh) -> ValueModel:
    """The critic starts from the policy's backbone with a new value head (or from ``critic.model_path``)."""
    path = cfg.critic.model_path or cfg.model.path
    if path:
        return load_pretrained(path, head="value", mesh=mesh, seed=cfg.trainer.seed + 1, **checkpoint_overrides(cfg))
    return ValueModel.from_policy(policy, rngs=nnx.Rngs(cfg.trainer.seed + 1))


def build_reference(cfg: TrainConfig, policy: CausalLM, mesh: Mesh) -> Optional[nnx.State]:
    """Parameters of the reference policy: ``ref.model_path``, or a copy of the policy's initial weights. A policy
    with LoRA adapters needs no copy: its reference is its own frozen base weights, read in place (None here)."""
    if cfg.ref.model_path:
        model = load_pretrained(cfg.ref.model_path, mesh=mesh, **checkpoint_overrides(cfg))
        return nnx.state(model, nnx.Param)
    if has_adapters(policy):
        return None
    return jax.tree.map(jnp.copy, nnx.state(policy, nnx.Param))


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


def sampling_params(
    cfg: TrainConfig, tokenizer: Optional[Tokenizer], *, validation: bool = False, greedy_baseline: bool = False
) -> SamplingParams:
    """How the trainer samples: training rollouts (``rollout.*``), validation (``rollout.val_*``) or the one
    greedy response per prompt whose reward is ReMax's baseline. Without a tokenizer (checking the config before
    the vocabulary is loaded) there is no EOS and padding is token 0."""
    eos = tuple(tokenizer.eos_ids) if tokenizer is not None else ()  # every id that ends a response
    tokens = dict(eos_token_ids=eos, pad_token_id=0 if tokenizer is None else tokenizer.pad_id,
                  max_num_seqs=cfg.rollout.max_num_seqs)
    if greedy_baseline:
        return SamplingParams(max_new_tokens=cfg.rollout.max_response_length, greedy=True, n=1, **tokens)
    if validation:
        greedy = cfg.rollout.val_temperature <= 0
        return SamplingParams(
            max_new_tokens=cfg.rollout.max_response_length, temperature=1.0 if greedy else cfg.rollout.val_temperature,
            greedy=greedy, n=cfg.rollout.val_n, **tokens,
        )
    return SamplingParams(
        max_new_tokens=cfg.rollout.max_response_length, temperature=cfg.rollout.temperature, top_k=cfg.rollout.top_k,
        top_p=cfg.rollout.top_p, n=cfg.rollout.n, **tokens,
    )


def forward_micro_batching(cfg: TrainConfig, section: str) -> dict:
    """How forward passes (log-probs, values, reward scores) cut the rollout batch: like ``section``'s updates,
    or ``rollout.log_prob_micro_batch_size`` sequences per shard when set."""
    update = getattr(cfg, section)
    if update.use_dynamic_bsz:
        return {"max_token_len": update.ppo_max_token_len}
    return {"micro_batch_size": cfg.rollout.log_prob_micro_batch_size or update.ppo_micro_batch_size}
