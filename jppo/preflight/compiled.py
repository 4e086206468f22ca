"""Every program a training run compiles, built from the config alone and compiled for a :class:`Target`'s
compile-only devices (``python -m jppo.plan --compile-for TARGET``): no weight, no data file, no accelerator.

The programs are the trainer's own (:class:`~jppo.engine.update.UpdateStep` of each role as
:class:`~jppo.run.learn.Learner` makes it, the forward passes of :mod:`jppo.engine.forward` as
:class:`~jppo.run.collect.Collector` makes them, the sampler's :func:`~jppo.rollout.decode.make_generate_fn`),
lowered for abstract arguments: the run's models and train states as ``ShapeDtypeStruct``s with their shardings
(:func:`jppo.run.build.abstract_models`, :func:`jppo.engine.state.abstract_train_state`) and batches of the largest
shapes the config lets a step make. Traced under the target's mesh, they choose the target's kernels
(:func:`jppo.parallel.mesh.platform`).

Batch shapes: an update's ``ppo_epochs x rollout batch / mini-batch`` optimizer steps; fixed micro-batches as the
config cuts them; with a token budget (``use_dynamic_bsz``) the cut of full-length rows (every prompt and response
at its limit: ``budget // (P + L)`` sequences in each packed row). The rollout's prompts are padded to
``bucket(data.max_prompt_length)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import pathlib
import re
import tempfile
from typing import Callable, Optional

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jppo.config import TrainConfig, check_mesh, views
from jppo.core.errors import one_line
from jppo.core.experience import Experience
from jppo.engine import abstract_train_state, log_prob_fn, value_fn
from jppo.engine.assemble import assemble_rows
from jppo.engine.objectives import loss_inputs
from jppo.parallel.mesh import ROW_AXES, batch_shards, make_mesh, split_devices
from jppo.preflight import hlo
from jppo.preflight.footprint import model_config
from jppo.preflight.sampler_memory import prompt_width, sampler_prompt_width
from jppo.preflight.targets import Target
from jppo.rollout.decode import make_generate_fn
from jppo.run import build
from jppo.run.learn import Learner

PROGRAMS = ("actor_update", "critic_update", "old_log_prob", "ref_log_prob", "values", "rollout", "validation")


@dataclasses.dataclass(frozen=True)
class Compiled:
    """One program compiled for a target (or the first line of why not). ``xla_bytes``: XLA's bytes per device
    (``memory_analysis()``: arguments + outputs - donated + temporaries), ``temp_bytes`` the temporaries alone (a
    step's activations and scratch); ``hbm_bytes``: on a TPU, the program's HBM by XLA's buffer assignment
    (:func:`device_memory_bytes`, less than ``xla_bytes``); ``peak_bytes``: ``xla_bytes`` plus what the run keeps
    on the device besides the program's arguments (train states, reference, the others' weights), to check against
    the device's memory; ``flops``: per device, matrix products only, loops multiplied by their trip counts
    (:func:`jppo.preflight.hlo.flops`); ``decode_step_collectives``: those of one turn of the decoding loop (one
    token of every row), the rollout's only."""

    name: str
    compiled: bool
    error: Optional[str] = None
    xla_bytes: Optional[int] = None
    temp_bytes: Optional[int] = None
    peak_bytes: Optional[int] = None
    hbm_bytes: Optional[int] = None
    collectives: dict = dataclasses.field(default_factory=dict)
    decode_step_collectives: Optional[dict] = None
    flops: Optional[float] = None


def device_bytes(tree) -> int:
    """Bytes one device holds of ``tree``'s abstract arrays (the largest shard of each)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if getattr(leaf, "sharding", None) is not None else leaf.shape
        total += math.prod(shape) * jnp.dtype(leaf.dtype).itemsize
    return total


def abstract(shape, dtype, mesh: Mesh, spec: PartitionSpec = PartitionSpec()) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def batch_rows(cfg: TrainConfig, mesh: Mesh, per_token: Optional[tuple[str, ...]]) -> Experience:
    """The rollout batch's rows as the devices receive them (:func:`jppo.engine.assemble.device_rows`): ``B n``
    rows over the row axes, tokens and the per-token fields ``per_token`` (None: tokens only)."""
    n, p, length = cfg.data.train_batch_size * cfg.rollout.n, prompt_width(cfg), cfg.rollout.max_response_length
    rows = lambda width, dtype: abstract((n, width), dtype, mesh, PartitionSpec(ROW_AXES))  # noqa: E731
    fields = {name: rows(length, jnp.float32) for name in per_token or ()}
    return Experience(prompt_ids=rows(p, jnp.int32), prompt_mask=rows(p, bool), response_ids=rows(length, jnp.int32),
                      response_attention=rows(length, bool),
                      response_mask=None if per_token is None else rows(length, bool), **fields)


def cut_shape(cfg: TrainConfig, sequences: int, micro_batch_size: Optional[int], max_token_len: Optional[int]):
    """``(K, S)``: micro-batches and slots of a shard's ``sequences`` (module docstring: full-length rows)."""
    if max_token_len is None:
        return sequences // micro_batch_size, micro_batch_size
    per_row = max(1, max_token_len // (prompt_width(cfg) + cfg.rollout.max_response_length))
    per_row = min(per_row, sequences)
    return -(-sequences // per_row), per_row


def micro_batches(rows: Experience, mesh: Mesh, lead: tuple[int, ...], slots: int, width: Optional[int]):
    """The micro-batches :func:`jppo.engine.assemble.assemble` makes of ``rows`` for a cut ``[*lead, D, slots]``,
    as abstract arrays sharded like its output."""
    d = batch_shards(mesh)
    cut = jax.ShapeDtypeStruct((*lead, d, slots), jnp.int32)
    out = jax.eval_shape(functools.partial(assemble_rows, width=width), rows, cut, cut)
    spec = PartitionSpec(*([None] * len(lead)), ROW_AXES)
    return jax.tree.map(lambda x: abstract(x.shape, x.dtype, mesh, spec), out)


def update_batch(cfg: TrainConfig, role: str, mesh: Mesh):
    view, d = views.engine_view(cfg, role), batch_shards(mesh)
    sequences = cfg.data.train_batch_size * cfg.rollout.n
    steps = view.ppo_epochs * (sequences // view.ppo_mini_batch_size)
    budget = view.ppo_max_token_len if view.use_dynamic_bsz else None
    k, s = cut_shape(cfg, view.ppo_mini_batch_size // d, view.ppo_micro_batch_size, budget)
    return micro_batches(batch_rows(cfg, mesh, loss_inputs(view)), mesh, (steps, k), s, budget)


def forward_batch(cfg: TrainConfig, role: str, mesh: Mesh):
    sizes = views.forward_micro_batching(cfg, role)
    budget = sizes.get("max_token_len")
    sequences = cfg.data.train_batch_size * cfg.rollout.n // batch_shards(mesh)
    k, s = cut_shape(cfg, sequences, sizes.get("micro_batch_size"), budget)
    return micro_batches(batch_rows(cfg, mesh, None), mesh, (k,), s, budget)


def prompts(cfg: TrainConfig, mesh: Mesh, batch: int, n: int) -> tuple:
    """``(prompt_ids, prompt_mask)`` of ``batch`` prompts as the sampler pads them (to a multiple of the batch
    shards; with ``rollout.env`` one row per sample, each a turn's whole context)."""
    rows = batch * n if cfg.rollout.env is not None else batch
    rows += (-rows) % batch_shards(mesh)
    width = sampler_prompt_width(cfg)
    spec = PartitionSpec(ROW_AXES)
    return abstract((rows, width), jnp.int32, mesh, spec), abstract((rows, width), bool, mesh, spec)


def sampling_params(cfg: TrainConfig, evaluation: bool):
    params = views.sampling_params(cfg, None, evaluation=evaluation)
    return dataclasses.replace(params, n=1) if cfg.rollout.env is not None else params


def lowerings(
    cfg: TrainConfig, mesh: Mesh, rollout_mesh: Optional[Mesh] = None
) -> tuple[dict[str, Callable[[], jax.stages.Lowered]], dict, int]:
    """``(lower, resident_in, resident)``: for each program the run compiles, a function lowering it; the bytes per
    device of its arguments the run keeps on the device anyway; and the bytes per device of all the run keeps
    (train states, reference weights, the off-policy steps' queue of parameters). ``rollout_mesh``
    (``rollout.devices``): the sampler's programs lowered there, on the weights as they move to it
    (:mod:`jppo.run.rollout_mesh`), and nothing else kept on its devices."""
    models = build.abstract_models(cfg, model_config(cfg), mesh)
    actor_view = views.engine_view(cfg, "actor")
    actor = abstract_train_state(models.actor.params, actor_view, mesh, frozen=models.actor.frozen)
    critic = None if models.critic is None else abstract_train_state(
        models.critic.params, views.engine_view(cfg, "critic"), mesh, frozen=models.critic.frozen)
    learner = Learner.create(cfg, mesh, models.actor.graphdef, None if critic is None else models.critic.graphdef)
    # trainer.off_policy_steps k: the weight queue holds k copies of the actor's trained parameters
    queue = cfg.trainer.off_policy_steps * device_bytes(actor.params)
    resident = device_bytes(actor) + device_bytes(critic) + device_bytes(models.reference) + queue
    lower, resident_in = {}, {}

    def under_mesh(fn, *args, on: Mesh = mesh):
        def run():
            with jax.set_mesh(on):
                return fn.lower(*args)
        return run

    lower["actor_update"] = lambda: learner.actor_step.lower(actor, update_batch(cfg, "actor", mesh))
    resident_in["actor_update"] = device_bytes(actor)
    if critic is not None:
        lower["critic_update"] = lambda: learner.critic_step.lower(critic, update_batch(cfg, "critic", mesh))
        resident_in["critic_update"] = device_bytes(critic)
    chunk, temperature = cfg.actor.log_prob_chunk_size, cfg.rollout.temperature
    log_probs = log_prob_fn(models.actor.graphdef, temperature=temperature, chunk_size=chunk)
    if views.old_log_prob_source(cfg) == "recompute":
        lower["old_log_prob"] = under_mesh(log_probs, actor.weights, forward_batch(cfg, "actor", mesh))
        resident_in["old_log_prob"] = device_bytes(actor.weights)
    if cfg.use_reference:
        base = models.base if models.base is not None else models.actor.graphdef
        ref_fn = log_probs if models.base is None else log_prob_fn(base, temperature=temperature, chunk_size=chunk)
        ref = models.reference if models.reference is not None else actor.frozen
        lower["ref_log_prob"] = under_mesh(ref_fn, ref, forward_batch(cfg, "actor", mesh))
        resident_in["ref_log_prob"] = device_bytes(ref)
    if critic is not None:
        role = "critic"
        lower["values"] = under_mesh(value_fn(models.critic.graphdef), critic.weights, forward_batch(cfg, role, mesh))
        resident_in["values"] = device_bytes(critic.weights)
    if cfg.rollout.engine == "jppo":
        sampling = build.sampling_graphdef(cfg, models.policy)
        on, weights = mesh, actor.weights
        if rollout_mesh is not None:  # a whole replica on every rollout device, cast as the move casts it
            on, dtype = rollout_mesh, views.sampling_config(cfg, models.policy.config).dtype
            dtype = None if models.base is not None else dtype  # LoRA: the weights move as they are
            cast = weights if dtype is None else jax.eval_shape(lambda w: build.kept_in(w, dtype, copy=False), weights)
            weights = jax.tree.map(lambda x: abstract(x.shape, x.dtype, on), cast)
        key = jax.eval_shape(lambda: jax.random.key(0))
        key = abstract(key.shape, key.dtype, on)
        batches = {"rollout": (False, cfg.data.train_batch_size, cfg.rollout.n)}
        if cfg.trainer.val_every > 0 or cfg.trainer.val_before_train:
            batches["validation"] = (True, cfg.data.val_batch_size, cfg.rollout.val_n)
        for name, (evaluation, batch, n) in batches.items():
            generate = make_generate_fn(sampling, sampling_params(cfg, evaluation))
            lower[name] = under_mesh(generate, weights, *prompts(cfg, on, batch, n), key, on=on)
            # on a rollout mesh of its own the replica is all its devices keep (nothing elsewhere)
            resident_in[name] = device_bytes(weights) if rollout_mesh is None else resident
    return lower, resident_in, resident


def compile_run(cfg: TrainConfig, target: Target, only: Optional[tuple[str, ...]] = None) -> list[Compiled]:
    """Every program of a run of ``cfg`` compiled for ``target`` (those named in ``only``, when given), in
    :data:`PROGRAMS` order; a program that fails to lower or compile is reported with the first line of its
    error, the others still compiled."""
    # rollout.devices: the training programs on the first devices, the sampler's on the last ones
    training, sampling = split_devices(target.devices, cfg.rollout.devices)
    mesh = make_mesh(*check_mesh(cfg, len(target.devices), target.hosts), devices=training)
    lower, resident_in, resident = lowerings(cfg, mesh, make_mesh(-1, devices=sampling) if sampling else None)
    out = []
    for name in (name for name in PROGRAMS if name in lower and (only is None or name in only)):
        try:
            with without_persistent_cache(), tempfile.TemporaryDirectory() as report:
                # a compile-only executable cannot be loaded back from the persistent cache
                executable = lower[name]().compile(**report_options(target, report))
                memory = device_memory_bytes(report) if target.platform == "tpu" else None
        except Exception as error:  # noqa: BLE001 (what the compiler refuses is the finding: reported, not raised)
            out.append(Compiled(name, False, error=first_line(error)))
            continue
        steps = cfg.rollout.max_response_length - 1 if name in ("rollout", "validation") else None
        out.append(analyse(name, executable, resident - resident_in[name], steps, memory))
    return out


def report_options(target: Target, folder: str) -> dict:
    """Compiler options that make XLA:TPU write its buffer assignment's memory report into ``folder`` (none for a
    GPU, whose ``memory_analysis()`` counts device memory alone)."""
    if target.platform != "tpu":
        return {}
    return {"compiler_options": {"xla_dump_to": folder}}  # ~11 MB of text for a small update, no time measured


def device_memory_bytes(folder: str) -> Optional[int]:
    """The bytes of a TPU program's buffers in the chip's main memory (HBM, XLA's "default" memory space: its
    arguments, outputs and one block of temporaries), from the memory report of the buffer assignment XLA writes
    beside the compiled module (None when it wrote none).

    On a TPU ``memory_analysis()`` counts more temporaries than that block: the on-chip memory's buffers (VMEM,
    memory space 1: prefetched weights, a loop's small carries) and more, unexplained, which grows with the
    program. Compiled for v5p:2x2x2: quickstart_moe at d 256 on ``mesh.data=8``, 159.8 MiB of temporaries by
    ``memory_analysis()``, a block of 121.8 MiB in HBM and 46.1 MiB of buffers in VMEM; Qwen2.5-0.5B's update of
    the shipped GSM8K config, 2.49 GiB by ``memory_analysis()``, 1.68 GiB in HBM and 47 MiB in VMEM; Qwen3-30B-A3B's
    on v5p:4x4x4, 8.71 and 5.84 GiB. MaxText's logs say the same of the former: the compiler may over-estimate
    HBM. On a GPU both agree (Qwen3-30B-A3B's update on h200x8: 43.57 GiB each)."""
    reports = sorted(pathlib.Path(folder).glob("*memory-usage-report.txt"))
    if not reports:
        return None
    total = re.search(r"Memory Space: default \(color=0\)\s*\nTotal bytes: (\d+)", reports[-1].read_text())
    return int(total[1]) if total else None


def first_line(error: Exception) -> str:
    """The compiler's message in one line, without the Python stack XLA appends to it."""
    text = one_line(error).split(" Suspected Python Code Location")[0]
    return text if len(text) <= 400 else text[:399] + "…"


@contextlib.contextmanager
def without_persistent_cache():
    """JAX's persistent compilation cache switched off (and back as it was). JAX decides once per process whether
    it uses the cache: the decision is reset on the way in and out, so it is made again with the setting of the
    moment."""
    from jax.experimental.compilation_cache import compilation_cache  # noqa: PLC0415

    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", before)
        compilation_cache.reset_cache()


def analyse(name: str, executable, elsewhere: int, decode_steps: Optional[int] = None,
            device_memory: Optional[int] = None) -> Compiled:
    """The figures of a compiled program; ``elsewhere``: the bytes the run keeps on the device outside its
    arguments; ``decode_steps``: the turns of its decoding loop the flops count (its longest); ``device_memory``:
    a TPU program's bytes in HBM by its buffer assignment (:func:`device_memory_bytes`)."""
    memory = executable.memory_analysis()
    xla = (memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes
           + memory.temp_size_in_bytes)
    module = hlo.parse(executable.as_text())
    decoding = name in ("rollout", "validation")
    return Compiled(
        name, True, xla_bytes=int(xla), temp_bytes=int(memory.temp_size_in_bytes), peak_bytes=int(xla + elsewhere),
        hbm_bytes=device_memory,
        collectives=hlo.collectives(module),
        decode_step_collectives=hlo.decode_step_collectives(module) if decoding else None,
        flops=hlo.flops(module, decode_steps),
    )
