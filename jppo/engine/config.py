"""Settings of the update engine: frozen dataclasses with verl's names, shared by the trainer's config schema.

The trainer's config file uses these same classes for its ``actor`` and ``critic`` sections, with verl's
convention that ``ppo_mini_batch_size`` counts *prompts*; the trainer multiplies it by ``rollout.n`` before handing
the config to the engine, where every batch size counts *sequences* (prompt + one response). Micro-batch sizes
count sequences per batch shard everywhere, as verl's ``*_per_gpu`` sizes do.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

NORMALIZATIONS = ("global", "per_micro_batch")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """Optimizer of one model: AdamW (or SGD), warm-up and decay, global-norm clipping of the whole gradient."""

    name: str = "adamw"
    lr: float = 1e-6
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global norm of the accumulated gradient; <= 0 turns clipping off
    warmup_steps: int = 0
    lr_schedule: str = "constant"  # "constant" or "cosine"
    decay_steps: int = 0  # optimizer steps of the cosine decay after warm-up; 0: the trainer's run after warm-up
    min_lr_ratio: float = 0.0


@dataclasses.dataclass(frozen=True)
class UpdateConfig:
    """What actor and critic updates share: how a rollout batch becomes optimizer steps, and how losses normalize.

    ``ppo_mini_batch_size`` sequences make one optimizer step; each is cut on every batch shard into micro-batches
    of ``ppo_micro_batch_size`` sequences, or, with ``use_dynamic_bsz``, packed into micro-batches of at most
    ``ppo_max_token_len`` tokens. ``normalization: per_micro_batch`` is the legacy (split-dependent) behaviour,
    kept only to compare with old curves.
    """

    ppo_mini_batch_size: int = 8
    ppo_micro_batch_size: int = 1
    use_dynamic_bsz: bool = False
    ppo_max_token_len: int = 4096
    ppo_epochs: int = 1
    shuffle: bool = True
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: Optional[float] = None  # C of seq-mean-token-sum-norm; None = the max response length
    normalization: str = "global"
    logprob_chunk_size: int = 256  # sequence chunk of the vocabulary projection in log-prob computations
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)


@dataclasses.dataclass(frozen=True)
class ActorConfig(UpdateConfig):
    """The policy update: a registered policy loss, optional entropy bonus and KL loss to the reference."""

    policy_loss: str = "vanilla"
    clip_ratio: float = 0.2
    clip_ratio_low: Optional[float] = None
    clip_ratio_high: Optional[float] = None
    clip_ratio_c: float = 3.0
    tau_pos: float = 1.0  # SAPO gate temperatures
    tau_neg: float = 1.05
    dro_beta: Optional[float] = None  # DRO's quadratic penalty (required by policy_loss=dro)
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"


@dataclasses.dataclass(frozen=True)
class CriticConfig(UpdateConfig):
    """The value update: clipped value loss."""

    cliprange_value: float = 0.5
