"""What the audit compares: the meshes a role is audited on (every mesh the devices allow, or those a user names),
the cuts of a mini-batch into micro-batches (fixed sizes and token budgets), and the batch they cut, configured
prompts with random responses, advantages and log-probs (their values do not matter, only that every cut sees the
same ones)."""

from __future__ import annotations

import itertools

import numpy as np

from jppo.config import TrainConfig
from jppo.config.views import adapted_model_config
from jppo.core.errors import InvalidSetting
from jppo.core.experience import Experience
from jppo.models.moe import routing_dtype
from jppo.parallel.mesh import row_shards_of
from jppo.run import build

ONE_DEVICE = (1, 1, 1, 1)  # the mesh that runs every cut
SEQUENCE = 2  # the sequence axis of the context-parallel meshes the audit adds


def mesh_shapes(num_devices: int, rows: int) -> list[tuple[int, int, int, int]]:
    """Every (data, fsdp, tensor, 1) with product ``num_devices`` whose batch shards divide ``rows``, and the
    context-parallel (data, 1, 1, 2) and (data, 1, tensor, 2) of the same devices where they exist."""
    shapes = []
    for data, fsdp in itertools.product(range(1, num_devices + 1), repeat=2):
        if num_devices % (data * fsdp) == 0 and rows % (data * fsdp) == 0:
            shapes.append((data, fsdp, num_devices // (data * fsdp), 1))
    if num_devices % SEQUENCE == 0:
        rest = num_devices // SEQUENCE
        for data in sorted({rest, rest // 2} - {0}):
            if rest % data == 0 and rows % data == 0:
                shapes.append((data, 1, rest // data, SEQUENCE))
    return shapes


def parse_meshes(text: str, num_devices: int, rows: int) -> list[tuple[int, ...]]:
    """The meshes of ``--meshes``: ``DxFxTxS[xE]`` shapes (data, fsdp, tensor, sequence, and expert when given),
    comma-separated, each of at most ``num_devices`` devices whose batch shards (data x fsdp x expert) divide
    ``rows``, the mini-batch. A shape that breaks either is refused, naming it."""
    valid = (f"comma-separated DxFxTxS[xE] mesh shapes (e.g. 1x1x1x1,2x2x2x1,2x2x1x1x2) of at most {num_devices} "
             f"device{'s' if num_devices > 1 else ''} whose data x fsdp x expert divides the mini-batch of {rows}; on "
             "a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=8 simulates 8 devices")
    shapes = []
    for part in text.split(","):
        fields = part.strip().split("x")
        if len(fields) not in (4, 5) or not all(f.isdigit() and int(f) > 0 for f in fields):
            raise InvalidSetting("", "--meshes", text, valid)
        shape = tuple(int(f) for f in fields)
        if int(np.prod(shape)) > num_devices or rows % row_shards_of(shape):
            raise InvalidSetting("", "--meshes", text, valid)
        shapes.append(shape)
    return shapes


def audit_batch(cfg: TrainConfig, inputs: build.RunInputs, rows: int, seed: int = 0) -> Experience:
    """``rows`` sequences: configured prompts, random responses of random lengths (one empty), random
    advantages, old/ref/sampler log-probs, values and returns (what the losses need; their values do not matter
    here, but the sampler's differ from the old ones, so the rollout correction weighs or rejects rows); with
    ``actor.routing_replay: rollout``, a routing record of random experts."""
    rng = np.random.default_rng(seed)
    prompts = inputs.train_data.batch_at(0, rows, cfg.trainer.seed)[1]
    width = max(len(p) for p in prompts)
    # one more padding column where needed, so that fixed micro-batches' rows split over the sequence axis too
    width += (width + cfg.rollout.max_response_length) % SEQUENCE
    prompt_ids = np.zeros((rows, width), np.int32)
    prompt_mask = np.zeros((rows, width), bool)
    for i, p in enumerate(prompts):
        prompt_ids[i, width - len(p):] = p
        prompt_mask[i, width - len(p):] = True
    length = cfg.rollout.max_response_length
    lengths = rng.integers(1, length + 1, rows)
    lengths[rows // 2] = 0
    attention = np.arange(length)[None, :] < lengths[:, None]
    vocab = inputs.tokenizer.vocab_size
    response_ids = np.where(attention, rng.integers(0, vocab, (rows, length)), 0).astype(np.int32)
    noise = lambda scale: np.where(attention, rng.normal(scale=scale, size=(rows, length)), 0.0).astype(np.float32)  # noqa: E731
    old_log_prob, ref_log_prob, advantages, values, returns = noise(0.3) - 2.5, noise(0.3) - 2.5, *map(noise, [1.0] * 3)
    # the sampler's log-probs: a per-row offset and per-token noise, so that every rollout-correction mode clips
    # or rejects some rows and keeps others at its default threshold
    offsets = rng.normal(scale=0.5, size=(rows, 1)).astype(np.float32)
    rollout_log_prob = np.where(attention, old_log_prob - offsets, 0.0) - noise(0.3)
    routed = None
    if cfg.actor.routing_replay == "rollout":  # a sampler's record: k distinct experts per token and layer, at random
        model = adapted_model_config(cfg, "actor")
        draws = rng.random((rows, width + length, len(model.sparse_layers), model.num_experts))
        routed = np.argsort(draws, axis=-1)[..., :model.num_experts_per_tok].astype(routing_dtype(model.num_experts))
    return Experience(
        prompt_ids, prompt_mask, response_ids, attention, attention, old_log_prob=old_log_prob,
        ref_log_prob=ref_log_prob, advantages=advantages, values=values, returns=returns,
        rollout_log_prob=rollout_log_prob, routed_experts=routed,
    )


def cuts(mini_batch: int, shards: int, longest: int, every: bool, sequence: int = 1,
         bitwise: bool = False) -> list[tuple[str, dict]]:
    """Fixed micro-batches and token budgets, as overrides of the update config. ``every``: all of them (a whole
    shard, halves, single sequences; a tight and a loose budget); otherwise the two that cut finest (single
    sequences, the tight budget). Budgets are rounded up to a multiple of ``sequence``, so rows split over it.
    ``bitwise`` (``trainer.deterministic``): the fixed cuts alone, the mode's only ones."""
    if bitwise:
        return [cut for cut in cuts(mini_batch, shards, longest, every, sequence) if not cut[1]["use_dynamic_bsz"]]
    longest += (-longest) % sequence
    fixed = lambda m: (f"fixed micro={m}", {"use_dynamic_bsz": False, "ppo_micro_batch_size": m})  # noqa: E731
    budget = lambda t: (f"tokens<={t}", {"use_dynamic_bsz": True, "ppo_max_token_len": t})  # noqa: E731
    if not every:
        return [fixed(1), budget(longest)]
    per_shard = mini_batch // shards
    sizes = sorted({per_shard, per_shard // 2 if per_shard % 2 == 0 else per_shard, 1}, reverse=True)
    return [fixed(m) for m in sizes] + [budget(t) for t in sorted({longest, 2 * longest})]


def role_meshes(devices: int, mini: int, quick: bool, bitwise: bool = False) -> list[tuple[int, int, int, int]]:
    """The meshes a role is audited on: one device first, then every mesh of all devices (:func:`mesh_shapes`);
    ``quick``: of those, the pure data-parallel one, a 3-D one and the widest context-parallel one. ``bitwise``
    (``trainer.deterministic``): the ``data`` x ``fsdp`` meshes of a power-of-two size, the mode's only ones."""
    meshes = [ONE_DEVICE] + [shape for shape in mesh_shapes(devices, mini) if shape != ONE_DEVICE]
    if bitwise:
        shards = lambda shape: shape[0] * shape[1]  # noqa: E731
        pure = [shape for shape in meshes if shape[2] == shape[3] == 1 and not shards(shape) & (shards(shape) - 1)]
        return pure[:2] + pure[-1:] if quick and len(pure) > 3 else pure
    if quick:
        sequence = {shape for shape in meshes if shape[3] > 1}
        quick_ones = {ONE_DEVICE, (devices, 1, 1, 1), (2, 2, devices // 4, 1), max(sequence, default=ONE_DEVICE)}
        meshes = [shape for shape in meshes if shape in quick_ones]
    return meshes
