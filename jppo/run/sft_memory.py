"""The memory plan of a supervised fine-tuning run (``python -m jppo.plan`` of an SFT config; :mod:`jppo.run.sft`).

An SFT step is the actor's update alone, on ``sft.batch_size`` rows cut into micro-batches as ``actor`` says: no
critic, no reference, no training rollout. The terms are those of :mod:`jppo.run.memory`, for the policy
(symbols as there) and a micro-batch of SFT rows:

=====================  ====================================================================================
parameters             ``(n + t_lora) p``: the policy, and its adapters with ``actor.lora``
optimizer state        ``t a (2 + 1)``: AdamW's moments and the accumulator of ``optax.MultiSteps`` (none when
                       one micro-batch makes the step: K = ``sft.batch_size / (data x fsdp) /
                       actor.ppo_micro_batch_size`` = 1; SGD keeps no moments)
gradients              ``t p``: one micro-batch's, before it is added to the accumulator
weights in use         ``(V' D + one layer's weights / mesh.tensor) c``
activations            ``r (w / q) (L s + x) + b`` with ``r = actor.ppo_micro_batch_size`` rows of ``w =
                       sft.max_length`` tokens (the longest row the data may hold), or one packed row of ``w =
                       actor.ppo_max_token_len`` with ``actor.use_dynamic_bsz``
log-prob logits        ``3 r k V' a``, ``k = min(actor.log_prob_chunk_size, w / q)``
optimizer step         ``4 t a`` with an accumulator, ``2 t a`` without
validation             when the rows are ``data.task``'s demonstrations and the run validates: the sampler's
                       caches, a decoding step's logits, the prefill and its copy of the weights for
                       ``data.val_batch_size`` held-out prompts (the held-out greedy score, as an RL run's
                       validation plans them)
=====================  ====================================================================================

The peak is the persistent terms plus the largest phase: the backward pass, the optimizer step, or the
validation's sampling. The held-out loss's forward pass keeps no activations for a backward pass and stays below
the update's backward pass. ``tests/test_plan.py`` holds the update's terms to XLA's ``memory_analysis()`` of the
compiled SFT update.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from jppo.config import TrainConfig
from jppo.core.inputs import file_list
from jppo.parallel.mesh import MESH_AXES
from jppo.run.footprint import (
    ACCUMULATOR_BYTES, abstract_params, activation_bytes, adapter_params, dtype_bytes, linear_attention,
    local_elements, logits_bytes, model_config, row_split, trained_elements, weights_in_use_bytes,
)
from jppo.run.memory import DIRECT_STEP_COPIES, OPTIMIZER_STEP_COPIES, MemoryPlan, Term, rollout_weights_term, \
    sampler_terms


def sft_micro_batch(cfg: TrainConfig) -> tuple[int, int]:
    """``(rows, width)`` of one SFT micro-batch on one device: ``actor.ppo_micro_batch_size`` rows of
    ``sft.max_length`` tokens, or one packed row of ``actor.ppo_max_token_len`` with ``actor.use_dynamic_bsz``."""
    if cfg.actor.use_dynamic_bsz:
        return 1, cfg.actor.ppo_max_token_len
    return cfg.actor.ppo_micro_batch_size, cfg.sft.max_length


def sft_accumulates(cfg: TrainConfig, mesh: dict[str, int]) -> bool:
    """Whether the SFT step keeps a gradient accumulator: unless one micro-batch per batch shard makes the step."""
    from jppo.engine.config import fixed_micro_batches  # noqa: PLC0415
    from jppo.run.sft import sft_view  # noqa: PLC0415 (the SFT loop's engine config)

    return fixed_micro_batches(sft_view(cfg), mesh["data"] * mesh["fsdp"]) != 1


def scores_held_out(cfg: TrainConfig) -> bool:
    """Whether the run samples the task's held-out prompts (:func:`jppo.run.sft.task_prompts`)."""
    validates = cfg.trainer.val_every > 0 or cfg.trainer.val_before_train
    return validates and cfg.data.task != "files" and not file_list(cfg.sft.train_files, "sft.train_files")


def sft_plan(cfg: TrainConfig, mesh_shape: Sequence[int], platform: str = "gpu") -> MemoryPlan:
    """Bytes per device of every term of the module docstring for the SFT run of ``cfg`` on a mesh of
    ``mesh_shape`` (``platform``: what the validation's prefill keeps of attention's softmax)."""
    mesh = dict(zip(MESH_AXES, mesh_shape))
    policy, lora = model_config(cfg), cfg.actor.lora
    p, a = dtype_bytes(policy.param_dtype), ACCUMULATOR_BYTES
    n = local_elements(abstract_params(policy), mesh)
    adapters = local_elements(adapter_params(policy, lora), mesh)
    t = trained_elements(policy, "actor", lora, mesh)
    accumulates = sft_accumulates(cfg, mesh)
    copies = (2 if cfg.actor.optim.name == "adamw" else 0) + accumulates
    persistent = (
        Term("parameters/policy", (n + adapters) * p,
             f"n={n:,} + adapters t={adapters:,} x p={p}" if adapters else f"n={n:,} x p={p}"),
        Term("optimizer_state/policy", t * a * copies, f"t={t:,} x a={a} x {copies}"),
    )
    r, w = sft_micro_batch(cfg)
    q = row_split(w, mesh)
    k = min(cfg.actor.log_prob_chunk_size, w // q)
    backward = (
        Term("gradients/policy", t * p, f"t x p={p}"),
        Term("weights_in_use/policy", weights_in_use_bytes(policy, mesh), "(V'D + layer/tensor) x c"),
        Term("activations/policy", activation_bytes(policy, r, w, mesh),
             f"r={r} x w={w}{f' / q={q}' if q > 1 else ''} x (L s + x){' + b' if linear_attention(policy, w) else ''}"
             f"{' remat' if policy.remat else ''}"),
        Term("logits/policy", logits_bytes(policy, r, w, cfg.actor.log_prob_chunk_size, mesh), f"3 r k={k} V' a"),
    )
    step = OPTIMIZER_STEP_COPIES if accumulates else DIRECT_STEP_COPIES
    updates = {"sft backward": backward,
               "sft optimizer step": (Term("optimizer_step/policy", t * a * step, f"t x a x {step}"),)}
    validation = ()
    if scores_held_out(cfg):  # the sampler's terms of the validation batch (the last of sampler_terms')
        sampled = (*sampler_terms(cfg, policy, mesh, platform)[-1], rollout_weights_term(cfg, policy, mesh))
        validation = tuple(dataclasses.replace(term, name=f"{term.name}/validation") for term in sampled)
    return MemoryPlan(mesh, persistent, (), updates, validation)


def sft_program_bytes(cfg: TrainConfig, mesh_shape: Sequence[int], platform: str = "gpu") -> int:
    """The plan's bytes per device of the compiled SFT update: parameters and optimizer state, plus the larger of
    its backward pass and its optimizer step."""
    plan = sft_plan(cfg, mesh_shape, platform)
    phase = lambda title: sum(term.bytes for term in plan.updates[title])  # noqa: E731
    return plan.persistent_bytes + max(phase("sft backward"), phase("sft optimizer step"))
