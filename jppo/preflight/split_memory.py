"""The memory plans of a run with ``rollout.devices: N`` (:mod:`jppo.run.rollout_mesh`): one per mesh.

**The training mesh** (its shape from ``mesh.*`` on the other devices) holds what a colocated run's plan holds
(:func:`jppo.preflight.memory.memory_plan`) but the sampler: no KV cache, no rollout weights. In their place, while the
weights move, a phase ``weight move`` holds their copy cast to the rollout dtype on the training devices (each
device its shards: ``sum_w |w| / shards(w) x c_s``, norms' scales kept in ``p`` and not copied); none when nothing
is cast (the same dtype, or LoRA, whose weights move as they are).

**The rollout mesh** (``data`` = N) holds, per device, a whole replica of the weights (``sum_w |w| x c_s``, the
norms' scales and, with LoRA, every weight in ``p``, the adapters too) and the sampler's caches for its share of
the rows: the caches, a decoding step's logits and the prefill of the training or the validation batch, whichever
needs more (:func:`jppo.preflight.sampler_memory.sampler_terms` on that mesh).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

from jppo.config import ConfigError, TrainConfig
from jppo.config.views import sampling_config
from jppo.parallel.mesh import MESH_AXES
from jppo.preflight.footprint import Term, abstract_params, adapter_params, dtype_bytes, human, model_config, shards
from jppo.preflight.memory import MemoryPlan, memory_plan
from jppo.preflight.sampler_memory import sampler_terms


def weight_bytes(cfg: TrainConfig, mesh: dict[str, int]) -> tuple[int, int]:
    """``(moved, cast)``: the bytes of one rollout device's replica of the policy's weights, and those of the cast
    copy one training device of ``mesh`` makes of its shards before the move (0 when nothing is cast)."""
    from flax import nnx  # noqa: PLC0415 (the shapes only)

    from jppo.models.kv_cache import NORM_SCALES  # noqa: PLC0415
    from jppo.models.sharding import logical_names  # noqa: PLC0415

    policy = model_config(cfg)
    lora = cfg.actor.lora.enabled
    c_s, p = dtype_bytes(sampling_config(cfg, policy).dtype), dtype_bytes(policy.param_dtype)
    cast_all = not lora and sampling_config(cfg, policy).dtype != policy.param_dtype
    moved = cast = 0
    for path, variable in nnx.to_flat_state(abstract_params(policy)):
        elements = math.prod(variable.shape)
        if cast_all and path[-1] not in NORM_SCALES:
            moved += elements * c_s
            cast += elements // shards(variable.shape, logical_names(variable), mesh) * c_s
        else:
            moved += elements * p
    if lora:
        moved += sum(math.prod(v.shape) for _, v in nnx.to_flat_state(adapter_params(policy, cfg.actor.lora))) * p
    return moved, cast


def split_plans(cfg: TrainConfig, training_shape: Sequence[int],
                platform: str = "gpu") -> tuple[MemoryPlan, MemoryPlan]:
    """The per-device plans of the training mesh of ``training_shape`` and of the rollout mesh (module docstring)."""
    colocated = memory_plan(cfg, training_shape, platform)
    mesh = colocated.mesh
    moved, cast = weight_bytes(cfg, mesh)
    updates = dict(colocated.updates)
    if cast:
        updates["weight move"] = (Term("weight_move", cast, "sum_w |w| / shards(w) x c_s"),)
    # the training mesh samples nothing, and its update never shares its devices with a rollout
    training = dataclasses.replace(colocated, rollout=(), validation=(), updates=updates, concurrent=False)
    rollout_mesh = dict(zip(MESH_AXES, (cfg.rollout.devices, 1, 1, 1, 1)))
    replica = Term("rollout_weights", moved, "sum_w |w| x c_s (a whole replica)")
    # the training batch's or the validation batch's caches, logits and prefill, whichever phase is larger
    phases = sampler_terms(cfg, model_config(cfg), rollout_mesh, platform)
    largest = max(phases, key=lambda terms: sum(term.bytes for term in terms))
    rollout = MemoryPlan(rollout_mesh, (), (*largest, replica), {})
    return training, rollout


def rollout_program_bytes(cfg: TrainConfig, platform: str = "gpu") -> dict[str, int]:
    """The plan's figure of each sampler program on the rollout mesh, keyed as ``--compile-for`` names them: the
    whole replica of the weights and that program's batch's caches, logits and prefill (``rollout``: the training
    batch; ``validation``: the validation batch, when the run validates). The rollout mesh's peak is the larger."""
    replica, _ = weight_bytes(cfg, dict.fromkeys(MESH_AXES, 1))
    rollout_mesh = dict(zip(MESH_AXES, (cfg.rollout.devices, 1, 1, 1, 1)))
    phases = sampler_terms(cfg, model_config(cfg), rollout_mesh, platform)
    return {name: replica + sum(term.bytes for term in terms) for name, terms in zip(("rollout", "validation"), phases)}


def check_rollout_fits(cfg: TrainConfig, limit: Optional[int]) -> None:
    """Refuses in one line a rollout mesh whose devices (``limit`` bytes each, what JAX's allocator takes; None:
    unknown, as on a CPU) cannot hold what the sampler keeps whatever the compiler does: a whole replica of the
    weights in the rollout dtype and the caches of its share of the rows (of the training or the validation batch,
    the larger). The plan's other terms (the prefill's working set, the logits) are estimates, which
    ``python -m jppo.plan`` compares with the device instead."""
    if not cfg.rollout.devices or limit is None:
        return
    replica, _ = weight_bytes(cfg, dict.fromkeys(MESH_AXES, 1))
    rollout_mesh = dict(zip(MESH_AXES, (cfg.rollout.devices, 1, 1, 1, 1)))
    caches = max(terms[0].bytes for terms in sampler_terms(cfg, model_config(cfg), rollout_mesh))
    if replica + caches > limit:
        dtype = sampling_config(cfg, model_config(cfg)).dtype
        raise ConfigError(
            f"rollout.devices={cfg.rollout.devices}: a rollout device holds a whole replica of the weights in {dtype} "
            f"({human(replica)}) and the caches of its rows ({human(caches)}), more than the {human(limit)} JAX takes "
            "of a device: lower rollout.max_num_seqs or data.val_batch_size, give the rollout more devices, or share "
            "the training mesh (rollout.devices=0)"
        )
