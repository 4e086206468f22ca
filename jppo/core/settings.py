"""The settings of an update, declared once where both the trainer's config and the components read them.

The trainer's config sections (:mod:`jppo.config.schema`) compose these records, and so do the engine's configs
(:mod:`jppo.engine.config`), the policy losses (:mod:`jppo.losses.policy`), the rollout correction
(:mod:`jppo.losses.rollout_correction`) and LoRA (:mod:`jppo.models.lora`), which import them from here, their one
home (the packages ``jppo.losses`` and ``jppo.engine`` export some of them too): they live at the bottom so that loading
and checking a config loads the config layer and ``jppo.core`` only. A record here holds fields and the checks that need
nothing but its own values; what needs a component (a registry's names, a model's shape) is that component's check, run
on the config by :mod:`jppo.run.checks`.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from jppo.core.errors import InvalidSetting

ROLLOUT_CORRECTION_MODES: tuple[str, ...] = ("none", "token_tis", "seq_tis", "geo_tis", "seq_rs", "geo_rs", "geo_mask")
# the modes that remove rows from the batch at collection, and how each aggregates a row's log-ratios
REJECTION_MODES: tuple[str, ...] = ("seq_rs", "geo_rs")


@dataclasses.dataclass(frozen=True)
class PolicyLossOptions:
    """Static options of the policy-loss variants (hashable, so usable as a ``jit`` static argument).

    Attributes:
        clip_ratio: default of both clip ratios (PPO epsilon; DPPO's divergence threshold).
        clip_ratio_low: ``eps_lo``; ``None`` uses ``clip_ratio``.
        clip_ratio_high: ``eps_hi``; ``None`` uses ``clip_ratio``.
        clip_ratio_c: dual-clip bound of ``vanilla`` (must be > 1); ratio truncation of DPPO.
        tau_pos: SAPO gate temperature for positive advantages.
        tau_neg: SAPO gate temperature for non-positive advantages.
        dro_beta: DRO's quadratic log-ratio penalty (required, > 0, by ``dro``).
    """

    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float = 3.0
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    dro_beta: float | None = None

    @classmethod
    def create(cls, **options: float | None) -> PolicyLossOptions:
        """Builds options from keyword arguments; an unknown name raises ``ValueError`` listing the valid ones."""
        valid = [field.name for field in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise ValueError(f"unknown policy loss option(s) {', '.join(unknown)}; valid options: {', '.join(valid)}")
        return cls(**options)

    @property
    def low(self) -> float:
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def high(self) -> float:
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high


@dataclasses.dataclass(frozen=True)
class RolloutCorrection:
    """How the policy loss corrects for the sampler's policy differing from the trainer's
    (:mod:`jppo.losses.rollout_correction`).

    Attributes:
        mode: one of :data:`ROLLOUT_CORRECTION_MODES`: ``none``, truncated importance weights per token
            (``token_tis``), sequence (``seq_tis``) or geometric mean (``geo_tis``), rows rejected outside
            ``[1/tau, tau]`` (``seq_rs``, ``geo_rs``) or given no policy gradient (``geo_mask``).
        threshold: ``tau``: the truncation of the TIS weights (> 0), or the acceptance band ``[1/tau, tau]`` of
            the rejection modes (> 1). Unused by ``none``.
    """

    mode: str = "none"
    threshold: float = 2.0

    def check(self) -> None:
        """:class:`~jppo.core.errors.InvalidSetting` naming the first setting the mode cannot use."""
        if self.mode not in ROLLOUT_CORRECTION_MODES:
            raise InvalidSetting(
                "rollout_correction.", "mode", self.mode, f"one of {', '.join(ROLLOUT_CORRECTION_MODES)}"
            )
        if self.mode in REJECTION_MODES + ("geo_mask",) and not self.threshold > 1:
            raise InvalidSetting("rollout_correction.", "threshold", self.threshold, f"> 1 for mode {self.mode!r}")
        if self.mode in ("token_tis", "seq_tis", "geo_tis") and not self.threshold > 0:
            raise InvalidSetting("rollout_correction.", "threshold", self.threshold, f"> 0 for mode {self.mode!r}")


# projection -> (jppo kernel attribute, Hugging Face module path within a layer)
LORA_TARGETS: dict[str, str] = {
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """``rank`` 0 turns LoRA off (the whole model trains); ``rank >= 1`` trains only adapters on
    ``target_modules`` (Hugging Face projection names), scaled by ``alpha / rank``. ``dropout`` must be 0."""

    rank: int = 0
    alpha: float = 16.0  # the adapters' output is scaled by alpha / rank (> 0)
    target_modules: list[str] = dataclasses.field(default_factory=lambda: list(LORA_TARGETS))
    dropout: float = 0.0

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def check(self) -> None:
        """:class:`InvalidSetting` for the first setting the adapters cannot use."""
        if not isinstance(self.rank, int) or self.rank < 0:
            raise InvalidSetting("lora.", "rank", self.rank, ">= 1 (0: LoRA off)")
        if not self.alpha > 0:
            raise InvalidSetting("lora.", "alpha", self.alpha, "> 0")
        unknown = [name for name in self.target_modules if not isinstance(name, str) or name not in LORA_TARGETS]
        if unknown or not self.target_modules or len(set(self.target_modules)) != len(self.target_modules):
            raise InvalidSetting(
                "lora.", "target_modules", list(self.target_modules),
                f"a non-empty list of distinct names among {', '.join(LORA_TARGETS)}",
            )
        if self.dropout != 0:
            raise InvalidSetting("lora.", "dropout", self.dropout, "0 (dropout on adapters is not implemented)")


NORMALIZATIONS = ("global", "per_micro_batch")
# where the engine's PPO ratio takes its old log-probs from (ActorConfig.old_log_prob; the trainer's key
# actor.old_log_prob: auto picks recompute or update, jppo.config.views.old_log_prob_source)
OLD_LOG_PROB_SOURCES = ("recompute", "update", "rollout")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """Optimizer of one model: AdamW (or SGD), warm-up and decay, global-norm clipping of the whole gradient."""

    name: str = "adamw"  # adamw | sgd (plain, no momentum: beta1, beta2, eps and weight_decay unused)
    lr: float = 1e-6  # peak learning rate, reached after warm-up (>= 0)
    weight_decay: float = 0.01  # AdamW's decoupled weight decay, scaled by the learning rate; 0: none
    beta1: float = 0.9  # Adam's decay of the gradient's first moment, in [0, 1)
    beta2: float = 0.999  # Adam's decay of the gradient's second moment, in [0, 1)
    eps: float = 1e-8  # Adam's epsilon, added to the second moment's root (> 0)
    grad_clip: float = 1.0  # max global norm of the accumulated gradient; <= 0 turns clipping off
    # The schedule counts TRAINING steps (verl's unit: its LR scheduler steps once per training step), so the LR is
    # constant over the optimizer steps of one training step (UpdateConfig.optimizer_steps_per_training_step).
    warmup_steps: int = 0  # training steps of the linear warm-up; the LR reaches ``lr`` on the last of them
    lr_schedule: str = "constant"  # after warm-up: "constant" (lr) or "cosine" (down to min_lr_ratio x lr)
    decay_steps: int = 0  # training steps of the cosine decay after warm-up; 0: the trainer's run after warm-up
    min_lr_ratio: float = 0.0  # cosine: the final learning rate as a fraction of lr, in [0, 1]; unused by constant


@dataclasses.dataclass(frozen=True)
class UpdateFields:
    """What actor and critic updates share, in units a user and the engine count alike.

    Each mini-batch is cut on every batch shard into micro-batches of ``ppo_micro_batch_size`` sequences, or, with
    ``use_dynamic_bsz``, packed into micro-batches of at most ``ppo_max_token_len`` tokens. ``normalization:
    per_micro_batch`` is the legacy (split-dependent) behaviour, kept only to compare with old curves.
    """

    ppo_micro_batch_size: int = 1  # sequences per batch shard in one micro-batch (without use_dynamic_bsz)
    use_dynamic_bsz: bool = False  # cut micro-batches by a token budget (ppo_max_token_len) instead of a count
    ppo_max_token_len: int = 4096  # use_dynamic_bsz: most real tokens (prompt + response) per micro-batch on a shard
    ppo_epochs: int = 1  # passes over the step's batch, each cut into mini-batches (one optimizer step each)
    shuffle: bool = True  # a new random order of the sequences every epoch before the mini-batch cut
    loss_agg_mode: str = "token-mean"  # how per-token losses reduce (jppo.losses.aggregate.AGG_MODES)
    # C of seq-mean-token-sum-norm. An update refuses None; in a trainer config None means rollout.max_response_length
    loss_scale_factor: Optional[float] = None
    normalization: str = "global"  # global (the whole mini-batch) | per_micro_batch (legacy, split-dependent)
    log_prob_chunk_size: int = 256  # sequence chunk of the vocabulary projection in log-probs (>= T: one, no remat)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)


@dataclasses.dataclass(frozen=True)
class _PolicyLossName(UpdateFields):
    """The actor's policy loss by name (a base of its own so that the key comes before the loss's options in a
    config, as it always has)."""

    policy_loss: str = "vanilla"  # a name registered in jppo.losses.POLICY_LOSSES


@dataclasses.dataclass(frozen=True)
class ActorFields(PolicyLossOptions, _PolicyLossName):
    """The policy update: a registered policy loss, optional entropy bonus and KL loss to the reference, and the
    correction of the sampler/trainer mismatch (:mod:`jppo.losses.rollout_correction`). The policy loss's options
    (``clip_ratio``, ..., ``dro_beta``) are the fields of :class:`PolicyLossOptions`, declared above once: a new
    option is a new field there."""

    entropy_coeff: float = 0.0  # weight of the token entropy subtracted from the loss (an exploration bonus); 0: none
    use_kl_loss: bool = False  # add kl_loss_coef x the KL to the reference policy to the loss (GRPO's KL term)
    kl_loss_coef: float = 0.001  # weight of the KL loss (with use_kl_loss)
    kl_loss_type: str = "low_var_kl"  # the KL estimator of the loss (jppo.losses.kl.KL_KINDS: k1, k2, k3, k3+, ...)
    # weight of the load-balancing loss of a model with experts, from the whole mini-batch's expert fractions
    # (docs/algorithms.md); null: the model's config.json router_aux_loss_coef; 0: none
    router_aux_loss_coef: Optional[float] = None
    # weight of the router's z-loss, the mean over (token, layer with experts) of logsumexp(router logits)^2, over
    # the whole mini-batch (ST-MoE's; keeps the logits small); 0: none
    router_z_loss_coef: float = 0.0
    rollout_correction: RolloutCorrection = dataclasses.field(default_factory=RolloutCorrection)


@dataclasses.dataclass(frozen=True)
class CriticFields(UpdateFields):
    """The value update: clipped value loss."""

    cliprange_value: float = 0.5  # the new value may move this far from the rollout's value before its loss clips
    # the critic's own load-balancing loss weight, when its decoder has experts (as actor.router_aux_loss_coef);
    # null: the model's config.json router_aux_loss_coef; 0: none
    router_aux_loss_coef: Optional[float] = None
    # the critic's router z-loss weight, when its decoder has experts (as actor.router_z_loss_coef); 0: none
    router_z_loss_coef: float = 0.0
