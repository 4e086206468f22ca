"""The memory plan of a supervised fine-tuning run (``python -m jppo.plan`` of an SFT config; :mod:`jppo.run.sft`).

An SFT step is the actor's update alone, on ``sft.batch_size`` rows cut into micro-batches as ``actor`` says: no
critic, no reference, no training rollout. The terms are those of :mod:`jppo.preflight.memory`, for the policy
(symbols as there) and a micro-batch of SFT rows:

=====================  ====================================================================================
parameters             ``(n + t_lora) p``: the policy, and its adapters with ``actor.lora``
optimizer state        ``t a (2 + 1)``: AdamW's moments and the accumulator of ``optax.MultiSteps`` (none when
                       one micro-batch makes the step: K = ``sft.batch_size / (data x fsdp x expert) /
                       actor.ppo_micro_batch_size`` = 1, the row axes as the run cuts them; SGD keeps no moments)
the update's phases    the RL actor's (:func:`jppo.preflight.memory.update_phases`: the layers' backward pass, the LM
                       head's, the optimizer step) for a micro-batch of ``r = actor.ppo_micro_batch_size`` rows of
                       ``w = sft.max_length`` tokens (the longest row the data may hold), or one packed row of
                       ``w = actor.ppo_max_token_len`` with ``actor.use_dynamic_bsz``
validation             when the rows are ``data.task``'s demonstrations and the run validates: the sampler's
                       caches, a decoding step's logits, the prefill and its copy of the weights for
                       ``data.val_batch_size`` held-out prompts (the held-out greedy score, as an RL run's
                       validation plans them)
=====================  ====================================================================================

The peak is the persistent terms plus the largest phase: a backward pass, the optimizer step, or the validation's
sampling. The held-out loss's forward pass keeps no activations for a backward pass and stays below
the update's backward pass. ``tests/test_plan.py`` holds the update's terms to XLA's ``memory_analysis()`` of the
compiled SFT update.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from jppo.config import TrainConfig
from jppo.parallel.mesh import MESH_AXES, row_shards_of
from jppo.preflight.footprint import (
    ACCUMULATOR_BYTES,
    Term,
    abstract_params,
    adapter_params,
    dtype_bytes,
    local_elements,
    model_config,
    trained_elements,
)
from jppo.preflight.memory import MemoryPlan, update_phases
from jppo.preflight.sampler_memory import rollout_weights_term, sampler_terms


def sft_micro_batch(cfg: TrainConfig) -> tuple[int, int]:
    """``(rows, width)`` of one SFT micro-batch on one device: ``actor.ppo_micro_batch_size`` rows of
    ``sft.max_length`` tokens, or one packed row of ``actor.ppo_max_token_len`` with ``actor.use_dynamic_bsz``."""
    if cfg.actor.use_dynamic_bsz:
        return 1, cfg.actor.ppo_max_token_len
    return cfg.actor.ppo_micro_batch_size, cfg.sft.max_length


def sft_accumulates(cfg: TrainConfig, mesh: dict[str, int]) -> bool:
    """Whether the SFT step keeps a gradient accumulator: unless one micro-batch per batch shard makes the step."""
    from jppo.engine.config import fixed_micro_batch_count  # noqa: PLC0415
    from jppo.run.sft import sft_view  # noqa: PLC0415 (the SFT loop's engine config)

    return fixed_micro_batch_count(sft_view(cfg), row_shards_of([mesh.get(axis, 1) for axis in MESH_AXES])) != 1


def scores_held_out(cfg: TrainConfig) -> bool:
    """Whether the run samples the task's held-out prompts (:func:`jppo.run.sft.task_prompts`)."""
    from jppo.run.sft import demonstrates_task  # noqa: PLC0415 (the SFT loop's own test)

    return (cfg.trainer.val_every > 0 or cfg.trainer.val_before_train) and demonstrates_task(cfg)


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
    updates = update_phases(policy, "policy", "sft", t, sft_micro_batch(cfg), cfg.actor.log_prob_chunk_size,
                            accumulates, mesh, platform)
    validation = ()
    if scores_held_out(cfg):  # the sampler's terms of the validation batch (the last of sampler_terms')
        sampled = (*sampler_terms(cfg, policy, mesh, platform)[-1], rollout_weights_term(cfg, policy, mesh))
        validation = tuple(dataclasses.replace(term, name=f"{term.name}/validation") for term in sampled)
    return MemoryPlan(mesh, persistent, (), updates, validation)


def sft_program_bytes(cfg: TrainConfig, mesh_shape: Sequence[int], platform: str = "gpu") -> int:
    """The plan's bytes per device of the compiled SFT update: parameters and optimizer state, plus the largest of
    its backward passes (the layers', the LM head's) and its optimizer step."""
    plan = sft_plan(cfg, mesh_shape, platform)
    phase = lambda title: sum(term.bytes for term in plan.updates[title])  # noqa: E731
    return plan.persistent_bytes + max(phase(f"sft {name}") for name in ("backward", "head", "optimizer step"))
