"""Tunix's side of :mod:`bench.peers`: Google's JAX trainer (``google-tunix``, its ``GRPOLearner`` with its own
vanilla sampler) set up to run jppo's training step, and its clock.

Both sides are JAX on the same XLA CPU backend, so what differs is the trainers, not the compilers. Matched with
jppo (and TRL) from the same jppo config:

- **weights and tokenizer**: the directory :func:`jppo.run.export.export_policy` wrote, loaded by Tunix's own Qwen2
  loader (``tunix.models.qwen2.params.create_model_from_safe_tensors``, float32) with the model settings read from its
  ``config.json``, and the export's tokenizer files through ``transformers.AutoTokenizer`` (Tunix's sampler encodes
  the prompt strings itself, BOS first, as jppo does). Tunix's logits on the task's prompts are checked against
  jppo's before training (``logits_max_abs_diff``, the same bound as TRL's).
- **task and reward**: the task's training prompts, ``train_batch_size`` a step in jppo's order, and jppo's own
  reward function on Tunix's decoded completions (a completion ended by EOS is finished).
- **the step**: ``rollout.n`` generations a prompt at temperature 1 (no top-k / top-p), prompts left-padded to
  jppo's ``data.max_prompt_length``, responses up to ``rollout.max_response_length`` tokens (lengths are matched as
  on the other sides: EOS is not suppressed; the shapes' wide vocabulary makes it rare, so responses run to the
  limit); GRPO's
  std-normalized group advantages, clip ``actor.clip_ratio``, no KL (``beta=0``, so no reference model is built),
  token-mean loss, AdamW at the constant learning rate after the actor's global-norm clipping, ``ppo_epochs`` as
  ``num_iterations``, and the same optimizer steps over the same micro-batches (:func:`tunix_batches`).

One difference is Tunix's own and kept: it generates per mini-batch and runs its ``num_iterations`` over that
mini-batch before generating for the next, where jppo and TRL generate the whole batch once and run the epochs over
all its mini-batches. At one mini-batch a step (``gsm8k_shape``) the two orders are the same step.

Seconds per step: the wall time between the ends of successive global steps (``_run_global_step``, one generation
and its optimizer steps, as jppo's training step), from a subclass that only notes the clock; phases from wrappers
around ``RLCluster.generate`` (``generate``) and ``get_old_per_token_logps`` (``old_log_prob``), the rest of the step
being ``update`` (rewards, advantages, the optimizer steps). Tunix is a benchmark-only tool, never a dependency of
jppo: without it (or with ``JPPO_BENCH_NO_TUNIX=1``) :mod:`bench.peers` reports its keys as ``None`` with the reason.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import pathlib
import time
from typing import Optional

import numpy as np

from jppo.config import TrainConfig
from jppo.run import build

HIDE_TUNIX_ENV = "JPPO_BENCH_NO_TUNIX"  # set (to anything but "" or "0") to measure as if Tunix were not installed


def tunix_missing() -> Optional[str]:
    """Why Tunix cannot be used here (``None``: it can)."""
    if os.environ.get(HIDE_TUNIX_ENV, "") not in ("", "0"):
        return f"Tunix hidden by {HIDE_TUNIX_ENV}={os.environ[HIDE_TUNIX_ENV]}"
    try:
        importlib.import_module("tunix.rl.grpo.grpo_learner")
    except ImportError as error:
        return f"Tunix is not installed ({error}); it is a benchmark-only tool: pip install google-tunix"
    return None


def tunix_version() -> Optional[str]:
    try:
        return importlib.metadata.version("google-tunix")
    except importlib.metadata.PackageNotFoundError:
        return None


def tunix_batches(cfg: TrainConfig) -> dict:
    """Tunix's batch settings for one jppo training step, in prompts (Tunix repeats each prompt ``num_generations``
    times itself): the step's prompts, ``ppo_mini_batch_size`` prompts an optimizer step, micro-batches of
    ``ppo_micro_batch_size`` sequences, and one generation (and one old-log-prob pass) per mini-batch."""
    n = cfg.rollout.n
    micro = cfg.actor.ppo_micro_batch_size
    if micro % n:
        raise ValueError(f"micro-batch of {micro} sequences: Tunix's micro-batches are whole groups of {n}")
    mini = cfg.actor.ppo_mini_batch_size
    if cfg.data.train_batch_size % mini or mini % (micro // n):
        raise ValueError(f"batch {cfg.data.train_batch_size}, mini-batch {mini}, micro-batch {micro // n} prompts: "
                         "each must divide the last")
    return {"prompts": cfg.data.train_batch_size, "mini_batch_size": mini, "train_micro_batch_size": micro // n,
            "rollout_micro_batch_size": mini, "compute_logps_micro_batch_size": mini,
            "optimizer_steps_per_training_step": cfg.actor.ppo_epochs * cfg.data.train_batch_size // mini}


def model_config(model_dir: pathlib.Path):
    """Tunix's ``Qwen2`` settings from the export's ``config.json``, float32."""
    import jax.numpy as jnp
    from tunix.models.qwen2 import model as qwen2

    hf = json.loads((model_dir / "config.json").read_text())
    return qwen2.ModelConfig(
        num_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"], embed_dim=hf["hidden_size"],
        hidden_dim=hf["intermediate_size"], num_heads=hf["num_attention_heads"], head_dim=hf["head_dim"],
        num_kv_heads=hf["num_key_value_heads"], rope_theta=hf["rope_theta"], norm_eps=hf["rms_norm_eps"],
        use_tied_embedding=hf["tie_word_embeddings"], dtype=jnp.float32, param_dtype=jnp.float32,
    )


def logits_max_abs_diff(model, model_dir: pathlib.Path, ids: np.ndarray) -> float:
    """Largest |jppo logit - Tunix logit| of the exported model on ``ids`` ([B, T], no padding)."""
    import jax.numpy as jnp

    from jppo.models import load_pretrained

    tokens = jnp.asarray(ids, jnp.int32)
    ours = np.asarray(load_pretrained(str(model_dir))(tokens))
    batch, length = ids.shape
    positions = jnp.broadcast_to(jnp.arange(length), (batch, length))
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((length, length), bool)), (batch, length, length))
    theirs, _ = model(tokens, positions, None, causal)
    return float(np.abs(ours - np.asarray(theirs)).max())


def run_tunix(cfg: TrainConfig, steps: int, out: pathlib.Path, check_ids: Optional[np.ndarray] = None) -> dict:
    """``steps`` training steps of Tunix's ``GRPOLearner`` matching ``cfg``; per-step seconds and phases."""
    import jax
    import optax
    import transformers
    from tunix.models.qwen2 import params as qwen2_params
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    model_dir = pathlib.Path(cfg.model.path)
    # the axes Tunix's default sharding names, one CPU device; Auto: Tunix's models leave the shardings to XLA
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    model = qwen2_params.create_model_from_safe_tensors(str(model_dir), model_config(model_dir), mesh)
    with mesh:  # as Tunix runs its models: inside their mesh
        diff = None if check_ids is None else logits_max_abs_diff(model, model_dir, check_ids)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    inputs = build.load_inputs(cfg)
    batches = tunix_batches(cfg)
    per_step = batches.pop("optimizer_steps_per_training_step")
    prompts_per_step = batches.pop("prompts")
    examples = build.task_of(cfg.data).examples("train", prompts_per_step * steps, cfg.trainer.seed)
    answers = {example.prompt: example for example in examples}
    dataset = [{"prompts": [e.prompt for e in examples[i:i + prompts_per_step]]}
               for i in range(0, len(examples), prompts_per_step)]

    optim = cfg.actor.optim
    if optim.name != "adamw" or optim.lr_schedule != "constant" or optim.warmup_steps:
        raise ValueError("the Tunix side runs AdamW at a constant learning rate, as the other sides do")
    adamw = optax.adamw(optim.lr, b1=optim.beta1, b2=optim.beta2, eps=optim.eps, weight_decay=optim.weight_decay)
    optimizer = optax.chain(optax.clip_by_global_norm(optim.grad_clip), adamw) if optim.grad_clip > 0 else adamw
    bucket = cfg.data.max_prompt_length  # Tunix pads every prompt to one width: jppo's longest
    max_tokens = cfg.rollout.max_response_length
    rollout = base_rollout.RolloutConfig(
        max_tokens_to_generate=max_tokens, temperature=cfg.rollout.temperature, top_p=1.0, top_k=None,
        max_prompt_length=bucket, kv_cache_size=bucket + max_tokens, eos_tokens=list(inputs.tokenizer.eos_ids),
    )
    cluster_config = rl_cluster_lib.ClusterConfig(
        role_to_mesh={role: mesh for role in (rl_cluster_lib.Role.ACTOR, rl_cluster_lib.Role.REFERENCE,
                                              rl_cluster_lib.Role.ROLLOUT)},
        rollout_engine="vanilla", offload_to_cpu=False, rollout_config=rollout,
        training_config=rl_cluster_lib.RLTrainingConfig(
            actor_optimizer=optimizer, eval_every_n_steps=10**9, max_steps=steps * per_step,
            checkpoint_root_directory=None, metrics_logging_options=None, pbar_description=None, **batches,
        ),
    )

    phases: list[dict[str, float]] = []
    marks: list[float] = []
    lengths: list[int] = []
    finished: list[bool] = []

    class TimedCluster(rl_cluster_lib.RLCluster):
        """Notes the seconds of Tunix's generation and old-log-prob pass, and which completions ended in EOS."""

        def generate(self, *args, **kwargs):
            start = time.perf_counter()
            output = super().generate(*args, **kwargs)
            phases[-1]["generate"] += time.perf_counter() - start
            ended = [len(tokens) < max_tokens for tokens in output.tokens]  # Tunix's tokens stop before the EOS
            finished[:] = ended
            lengths.extend(len(tokens) + end for tokens, end in zip(output.tokens, ended))  # with EOS, as jppo's
            return output

        def get_old_per_token_logps(self, *args, **kwargs):
            start = time.perf_counter()
            result = jax.block_until_ready(super().get_old_per_token_logps(*args, **kwargs))
            phases[-1]["old_log_prob"] += time.perf_counter() - start
            return result

    class TimedLearner(grpo_learner.GRPOLearner):
        """Notes the clock at the end of each global step (a generation and its optimizer steps)."""

        def _run_global_step(self, *args, **kwargs):
            phases.append({"generate": 0.0, "old_log_prob": 0.0})
            super()._run_global_step(*args, **kwargs)
            marks.append(time.perf_counter())

    def reward(prompts, completions, **_):
        if len(completions) != len(finished):
            raise RuntimeError(f"{len(completions)} completions to score, {len(finished)} generated")
        rows = [answers[prompt] for prompt in prompts]
        return [float(x) for x in inputs.reward_fn(list(completions), rows, list(finished))]

    cluster = TimedCluster(actor=model, tokenizer=tokenizer, cluster_config=cluster_config)
    algorithm = grpo_learner.GRPOConfig(
        num_generations=cfg.rollout.n, num_iterations=cfg.actor.ppo_epochs, beta=0.0, epsilon=cfg.actor.clip_ratio,
        loss_agg_mode="token-mean", advantage_estimator="grpo" if cfg.algorithm.norm_adv_by_std_in_grpo else "drgrpo",
    )
    learner = TimedLearner(rl_cluster=cluster, algo_config=algorithm, reward_fns=reward)
    marks.append(time.perf_counter())
    learner.train(dataset)
    seconds = [after - before for before, after in zip(marks, marks[1:])]
    for record, total in zip(phases, seconds):
        record["update"] = total - record["generate"] - record["old_log_prob"]
        record["step"] = total
    return {"steps": phases[: len(seconds)], "mean_response_length": float(np.mean(lengths)) if lengths else None,
            "logits_max_abs_diff": diff, "optimizer_steps_per_training_step": per_step}
