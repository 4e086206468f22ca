"""The configured mesh against the devices of a run: ``check_mesh`` resolves ``mesh.*`` for the devices and
processes it runs on, then checks what depends on that shape (whole heads per tensor shard, rows per batch shard,
each role's cut, tokens per sequence shard), with one-line messages naming the keys as the user wrote them; the
checks that hold on any mesh are :func:`jppo.config.check.check`'s."""

from __future__ import annotations

import math

from jppo.config.schema import TrainConfig
from jppo.config.views import adapted_model_config, engine_view, rollout_sequences, sampled_batches
from jppo.core.errors import ConfigError, one_line
from jppo.engine.driver import check_batch_sizes
from jppo.parallel.mesh import MESH_AXES, decoding_shards, expert_shards, resolve_shape, row_shards_of


def check_mesh(cfg: TrainConfig, num_devices: int, num_processes: int = 1) -> tuple[int, int, int, int, int]:
    """The training mesh's shape for ``num_devices`` (less the ``rollout.devices`` of a rollout mesh,
    :func:`training_devices`), and every batch size checked against the batch shards it implies: the engine's own
    check on the engine's view of each role, its messages naming the sizes as the user wrote them."""
    total, num_devices = num_devices, training_devices(cfg, num_devices, num_processes)
    try:
        shape = resolve_shape(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, num_devices, cfg.mesh.sequence,
                              cfg.mesh.expert)
    except ValueError as error:
        split = f" (the {total} devices less rollout.devices={cfg.rollout.devices})" if total != num_devices else ""
        raise ConfigError(one_line(error) + split + _fitting_sequence(cfg, num_devices)) from None
    check_heads(cfg, shape[2])
    check_experts(cfg, shape[4])
    check_slots(cfg, shape)
    check_bitwise_mesh(cfg, shape)
    shards, sequences = row_shards_of(shape), rollout_sequences(cfg)
    if sequences % shards:
        raise ConfigError(f"data.train_batch_size={cfg.data.train_batch_size} x rollout.n={cfg.rollout.n} = "
                          f"{sequences} sequences do not split over {shards} batch shards "
                          "(mesh.data x mesh.fsdp x mesh.expert)")
    if num_processes > 1 and cfg.algorithm.filter_groups.enable:
        raise ConfigError(f"algorithm.filter_groups.enable=True runs in one process only (this run has "
                          f"{num_processes}): each process would keep different prompts")
    if num_processes > 1 and cfg.data.train_batch_size % shards:
        raise ConfigError(f"data.train_batch_size={cfg.data.train_batch_size} prompts do not split over {shards} batch "
                          f"shards: with {num_processes} processes every process must hold whole prompts")
    forward = cfg.rollout.log_prob_micro_batch_size
    if forward is not None and (forward < 1 or (sequences // shards) % forward):
        raise ConfigError(
            f"rollout.log_prob_micro_batch_size={forward} must divide the "
            f"{sequences // shards} sequences per batch shard"
        )
    bucket, response = cfg.rollout.prompt_bucket, cfg.rollout.max_response_length
    for role in cfg.roles:
        view = engine_view(cfg, role)
        as_written = (f"{role}.ppo_mini_batch_size={getattr(cfg, role).ppo_mini_batch_size} (prompts) x "
                      f"rollout.n={cfg.rollout.n} = {view.ppo_mini_batch_size} sequences")
        try:
            check_batch_sizes(view, sequences, shards, role, as_written)
        except ValueError as error:
            raise ConfigError(one_line(error)) from None
        # context parallelism: every row of the role's passes (its token budget, or bucketed prompt + response) splits
        sizes = ({f"{role}.ppo_max_token_len": view.ppo_max_token_len} if view.use_dynamic_bsz else
                 {"rollout.prompt_bucket": bucket, "rollout.max_response_length": response})
        if any(size % shape[3] for size in sizes.values()):
            raise ConfigError(f"mesh.sequence={shape[3]} must divide " + " and ".join(
                f"{key}={size}" for key, size in sizes.items()) + f": it splits the tokens of each of {role}'s rows")
    return shape


def training_devices(cfg: TrainConfig, num_devices: int, num_processes: int = 1) -> int:
    """The devices the training mesh gets: all ``num_devices`` of the run, less the ``rollout.devices`` N of the
    rollout's own mesh. N must leave the training at least one device. With several processes each gives N / P of
    its devices to the rollout and keeps at least one (:func:`jppo.parallel.mesh.split_devices`): a process samples
    its own rows, and the weights reach its rollout devices from its own training devices."""
    n = cfg.rollout.devices
    if not n:
        return num_devices
    if n >= num_devices:
        raise ConfigError(f"rollout.devices={n} must be less than the run's {num_devices} devices: the training mesh "
                          "takes the others (0: the sampler shares the training mesh)")
    if n % num_processes:  # then N < D leaves every process (D / P devices each) training devices
        raise ConfigError(f"rollout.devices={n} must split evenly over the run's {num_processes} processes: each "
                          f"gives N / {num_processes} of its {num_devices // num_processes} devices to the rollout")
    return num_devices - n


def _fitting_sequence(cfg: TrainConfig, num_devices: int) -> str:
    """What to set when ``mesh.sequence`` = s does not divide the N devices: s' = gcd(s, N), and each token budget T
    of a role cut by tokens scaled to ``T s' / s``, which keeps the ``T / s`` tokens a device holds (and so its
    memory) as configured. Empty when the sequence axis is not what failed."""
    sequence = cfg.mesh.sequence
    if sequence <= 1 or num_devices % sequence == 0:
        return ""
    fitting = math.gcd(sequence, num_devices)
    budgets = {f"{role}.ppo_max_token_len": getattr(cfg, role).ppo_max_token_len
               for role in cfg.roles if getattr(cfg, role).use_dynamic_bsz}
    overrides = [f"mesh.sequence={fitting}"] + [f"{key}={size * fitting // sequence}" for key, size in budgets.items()]
    kept = f" (the same {min(budgets.values()) // sequence} tokens per device)" if budgets else ""
    return f"; on {num_devices} device(s) set {' '.join(overrides)}{kept}"


def check_bitwise_mesh(cfg: TrainConfig, shape: tuple[int, ...]) -> None:
    """``trainer.deterministic: bitwise`` on the mesh ``shape``: no tensor, sequence or expert axis (each splits a
    sum the mode keeps in one order), a power-of-two number of batch shards, and each role's mini-batch a
    power-of-two number of sequences per shard (the fixed summation tree's leaves: jppo.engine.bitwise)."""
    if cfg.trainer.deterministic != "bitwise":
        return
    for name, size in zip(MESH_AXES, shape):
        if name in ("tensor", "sequence", "expert") and size > 1:
            raise ConfigError(f"mesh.{name}={size} with trainer.deterministic='bitwise': it splits a sum the mode "
                              "keeps in one order (use mesh.data and mesh.fsdp)")
    shards = row_shards_of(shape)
    if shards & (shards - 1):
        raise ConfigError(f"mesh.data x mesh.fsdp = {shards} batch shards with trainer.deterministic='bitwise': a "
                          "power of two (the devices' sums meet in a binary tree)")
    for role in cfg.roles:
        per_shard = engine_view(cfg, role).ppo_mini_batch_size // shards
        if per_shard & (per_shard - 1):
            raise ConfigError(f"{role}.ppo_mini_batch_size={getattr(cfg, role).ppo_mini_batch_size} (prompts) x "
                              f"rollout.n={cfg.rollout.n} gives {per_shard} sequences per batch shard with "
                              "trainer.deterministic='bitwise': a power of two (the leaves of one binary tree)")


def check_experts(cfg: TrainConfig, expert: int) -> None:
    """``mesh.expert`` splits each layer's stacked experts into equal groups, one per device of the axis: it must
    divide ``num_experts`` of every model with experts (a model without experts only splits rows over it)."""
    for role in cfg.roles if expert > 1 else ():
        m = adapted_model_config(cfg, role)
        if m.sparse_layers and m.num_experts % expert:
            raise ConfigError(f"mesh.expert={expert} must divide the {role} model's num_experts={m.num_experts}: "
                              "each device of the axis holds an equal group of experts")


def check_heads(cfg: TrainConfig, tensor: int) -> None:
    """``mesh.tensor`` splits the head-major ``heads x head_dim`` projections into equal pieces: only a size that
    divides both head counts cuts between heads (a head split across devices replicates its activations)."""
    for role in cfg.roles if tensor > 1 else ():
        m = adapted_model_config(cfg, role)
        if m.num_heads % tensor or m.num_kv_heads % tensor:
            raise ConfigError(f"mesh.tensor={tensor} must divide the {role} model's num_heads={m.num_heads} and "
                              f"num_kv_heads={m.num_kv_heads}: use a mesh.tensor dividing both, mesh.fsdp for the rest")


def check_slots(cfg: TrainConfig, shape: tuple[int, ...]) -> None:
    """``rollout.max_num_seqs`` = S slots of continuous batching split over the sampler's decoding shards (the
    batch axes of the rollout's mesh, but ``mesh.expert`` on a mixture, whose group decodes in step): each device
    decodes S / shards of its own rows, so S must be a multiple of them. Otherwise the decoding loop would run on
    the global rows, every device decoding all S slots (shards x the flops, the caches of all S slots on each
    device, and a sum over the rows at every token), so it is refused, where continuous batching is on (S below a
    sampled batch's rows)."""
    slots = cfg.rollout.max_num_seqs
    if slots <= 0 or cfg.rollout.engine != "jppo":
        return
    mesh = dict(zip(MESH_AXES, (cfg.rollout.devices, 1, 1, 1, 1) if cfg.rollout.devices else shape))
    shards = decoding_shards(mesh)
    if adapted_model_config(cfg, "actor").sparse_layers:
        shards //= expert_shards(mesh)
    continuous = any(slots < -(-prompts // shards) * shards * n for prompts, n in sampled_batches(cfg))
    if slots % shards == 0 or not continuous:
        return
    below, above = slots // shards * shards, -(-slots // shards) * shards
    where = (f"rollout.devices={cfg.rollout.devices}" if cfg.rollout.devices else
             " x ".join(f"mesh.{axis}={mesh[axis]}" for axis in ("data", "fsdp", "sequence", "expert")
                        if mesh[axis] > 1 and (axis != "expert" or shards == decoding_shards(mesh))))
    raise ConfigError(f"rollout.max_num_seqs={slots} slots do not split over the sampler's {shards} decoding shards "
                      f"({where}): each device decodes its own max_num_seqs / {shards}; use "
                      + (f"{below} or {above}" if below else f"{above}"))
