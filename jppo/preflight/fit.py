"""Whether a run fits its devices: the plans of a config's meshes, what JAX's allocator takes of a device, and
every program compiled for a target beside the plan's figure for it (``python -m jppo.plan`` prints them)."""

from __future__ import annotations

from typing import Mapping, Optional

from jppo.config import ConfigError, TrainConfig, check_mesh
from jppo.parallel.mesh import MESH_AXES
from jppo.preflight.footprint import human
from jppo.preflight.memory import MemoryPlan, memory_plan, program_bytes

DEFAULT_MEM_FRACTION = 0.75  # the share of a GPU's memory JAX's allocator takes unless XLA_PYTHON_CLIENT_MEM_FRACTION


def allocator_bytes(device_bytes: int, environ: Mapping[str, str]) -> int:
    """What JAX's allocator takes of a device of ``device_bytes``: ``XLA_PYTHON_CLIENT_MEM_FRACTION`` of it (0.75
    unless set), as it preallocates on a GPU."""
    fraction = environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    try:
        share = DEFAULT_MEM_FRACTION if fraction is None else float(fraction)
    except ValueError:
        raise ConfigError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={fraction!r} must be a number in (0, 1]") from None
    return int(device_bytes * share)


def this_devices_limit() -> Optional[int]:
    """The allocator's limit on this machine's first device, as JAX reports it (None: it reports none, the CPU)."""
    import jax  # noqa: PLC0415 (only when planning for this machine)

    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


def over_limit(plan: MemoryPlan, limit: Optional[int], source: str, remat: bool = False) -> Optional[str]:
    """One warning line when the plan's peak exceeds ``limit`` bytes (what the allocator takes, from ``source``),
    suggesting only what the config has not done yet (``remat``: ``model.remat`` is already on)."""
    if limit is None or plan.peak_bytes <= limit:
        return None
    remedies = "shard more (mesh.fsdp) or cut smaller micro-batches" + (
        " (model.remat is already on)" if remat else ", or turn on model.remat")
    return (f"jppo.plan: warning: the peak of {human(plan.peak_bytes)} per device exceeds the {human(limit)} JAX's "
            f"allocator takes ({source}): expect out-of-memory; {remedies}")


def mesh_plans(cfg: TrainConfig, training_shape, platform: str = "gpu") -> tuple[MemoryPlan, Optional[MemoryPlan]]:
    """The training mesh's plan and, with ``rollout.devices``, the rollout mesh's
    (:mod:`jppo.preflight.split_memory`); None without one (the sampler's terms are then the training mesh's)."""
    if not cfg.rollout.devices:
        return memory_plan(cfg, training_shape, platform), None
    from jppo.preflight.split_memory import split_plans  # noqa: PLC0415

    return split_plans(cfg, training_shape, platform)


def sft_plans(cfg: TrainConfig, devices: int) -> tuple[MemoryPlan, None]:
    """An SFT config's plan (:mod:`jppo.preflight.sft_memory`) on the mesh ``python -m jppo.sft`` makes of
    ``devices``."""
    from jppo.preflight.sft_memory import sft_plan  # noqa: PLC0415
    from jppo.run import sft  # noqa: PLC0415 (the SFT loop: its mesh and engine config)

    return sft_plan(cfg, sft.mesh_shape(cfg, devices)), None


def compiled_report(cfg: TrainConfig, target_name: str, environ: Mapping[str, str]) -> dict:
    """Every program of an RL run compiled for ``target_name``'s compile-only devices (:mod:`jppo.preflight.compiled`),
    each beside the plan's figure for it and whether it fits what the allocator takes of a device."""
    from jppo.preflight import compiled, targets  # noqa: PLC0415 (jax and the models: only when compiling)

    target = targets.target(target_name)
    mesh_shape = check_mesh(cfg, len(target.devices), target.hosts)
    planned = program_bytes(cfg, mesh_shape, target.platform)
    if cfg.rollout.devices:  # the sampler's programs run on the rollout mesh: each its own batch's terms there
        from jppo.preflight.split_memory import rollout_program_bytes  # noqa: PLC0415

        planned.update({name: size for name, size in rollout_program_bytes(cfg, target.platform).items()
                        if name in planned})
    limit = target.device_memory
    if limit is not None and target.platform == "gpu":
        limit = allocator_bytes(limit, environ)
    rows = []
    for p in compiled.compile_run(cfg, target):
        fits = p.compiled and (limit is None or p.peak_bytes <= limit)
        rows.append({"name": p.name, "compiled": p.compiled, "error": p.error, "xla_bytes": p.xla_bytes,
                     "hbm_bytes": p.hbm_bytes, "plan_bytes": planned.get(p.name), "peak_bytes": p.peak_bytes,
                     "fits": fits,
                     "collectives": p.collectives, "decode_step_collectives": p.decode_step_collectives,
                     "flops": p.flops})
    report = {"target": target.name, "devices": len(target.devices), "hosts": target.hosts,
              "mesh": dict(zip(MESH_AXES, mesh_shape)), "device_memory": limit, "programs": rows}
    if cfg.rollout.devices:
        report["rollout_mesh"] = {"data": cfg.rollout.devices, "fsdp": 1, "tensor": 1, "sequence": 1}
    return report
