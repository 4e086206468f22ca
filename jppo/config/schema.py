"""The sections of :class:`TrainConfig`, every key written out with its type and default.

Each section is a frozen dataclass with verl's section and key names; the values are in the units a user writes
(``ppo_mini_batch_size`` counts prompts). Fields shared with a component's own config are declared once, in that
component's records, in :mod:`jppo.core.settings` and :mod:`jppo.core.inputs` (:class:`~jppo.core.settings.ActorFields`,
:class:`~jppo.core.settings.LoRAConfig`, ...), and composed here: the schema loads nothing of jppo but ``jppo.core``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from jppo.core.errors import InvalidSetting
from jppo.core.inputs import DataConfig, RewardConfig
from jppo.core.settings import ActorFields, CriticFields, LoRAConfig


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """The policy. ``path``: a local Hugging Face checkpoint directory; without it a model of the shape given by
    the other keys (:data:`RANDOM_MODEL`) is initialised at random (``trainer.seed``); ``dtype`` (compute),
    ``param_dtype`` (stored weights), ``remat``, ``attention`` (and its block sizes) and ``layer_loop`` apply to a
    checkpoint too, and to the critic built from it. Mixed precision is ``param_dtype: float32`` with
    ``dtype: bfloat16``; half-precision weights are refused, as Adam's updates would round away. ``tokenizer``: a
    directory holding ``tokenizer.json`` (default: ``path``), or ``builtin:<task>`` for a built-in task's character
    vocabulary (the default without ``path``).

    Every key but ``path`` and ``tokenizer`` is the :class:`~jppo.models.config.ModelConfig` field of its name, of
    its type, with the default of a small test model (tests/test_config.py holds them to ModelConfig's fields)."""

    path: Optional[str] = None  # a local Hugging Face checkpoint directory; None: a random model of the keys below
    tokenizer: Optional[str] = None  # a tokenizer.json directory or builtin:<task>; None: path, else builtin
    model_type: str = "qwen2"  # the family (llama | qwen2 | qwen3 | qwen3_moe, jppo.models.families): its fixed flags
    hidden_size: int = 64  # width of the residual stream
    intermediate_size: int = 256  # width of each MLP's hidden layer
    num_layers: int = 2  # decoder layers
    num_heads: int = 4  # query heads per attention layer; head size hidden_size / num_heads (even, for RoPE)
    num_kv_heads: Optional[int] = None  # key/value heads (grouped-query attention, divides num_heads); None: num_heads
    rope_theta: float = 10000.0  # base of RoPE's inverse frequencies (> 0)
    tie_word_embeddings: bool = True  # the output projection is the token embedding's transpose
    max_position_embeddings: int = 512  # context length for config.json; not enforced (RoPE angles are per position)
    dtype: str = "float32"  # compute dtype (float32 | bfloat16 | float16); softmax, norms and logits stay float32
    param_dtype: str = "float32"  # dtype the weights are stored and updated in; must not be half precision
    remat: bool = False  # recompute each layer in the backward pass instead of keeping its activations
    initializer_range: float = 0.02  # standard deviation of the random initial weights (> 0)
    attention: str = "reference"  # reference | xla | cudnn | blockwise | pallas | auto: how attention is computed

    attention_block_q: int = 512  # query tokens per block of blockwise/pallas attention (a power of two >= 8)
    attention_block_kv: int = 512  # key tokens per block of blockwise/pallas attention (a power of two >= 8)
    layer_loop: str = "auto"  # scan | unroll | auto (unrolled up to AUTO_UNROLL_LAYERS layers): the layers' loop
    # a mixture of experts (model_type: qwen3_moe; docs/algorithms.md): num_experts > 0 experts in every layer
    # (i + 1) divisible by decoder_sparse_step and not in mlp_only_layers, the others a dense MLP
    num_experts: int = 0  # experts per layer with experts (qwen3_moe only; 0: none)
    num_experts_per_tok: int = 1  # experts each token is routed to (top k of the router's softmax)
    moe_intermediate_size: int = 0  # width of each expert's hidden layer
    decoder_sparse_step: int = 1  # experts in every decoder_sparse_step-th layer
    mlp_only_layers: tuple[int, ...] = ()  # layers (from 0) with the dense MLP instead of experts
    norm_topk_prob: bool = False  # renormalize a token's top-k router probabilities to sum to 1
    router_aux_loss_coef: float = 0.0  # the model's load-balancing loss weight (actor.router_aux_loss_coef's default)
    # tokens per device in each round of the experts' exchange over mesh.expert (gather, experts, reduce-scatter),
    # each round recomputed in the backward pass: memory bounded by one round's, not the whole group's; 0: one round
    expert_chunk_size: int = 0

    def architecture(self) -> dict[str, Any]:
        """The ModelConfig fields this section gives (every key but where the model and its vocabulary come from)."""
        return {name: getattr(self, name) for name in RANDOM_MODEL}


# The ModelConfig fields a config gives for a model initialised at random, with the defaults of a small test model
# (their types and meaning are ModelConfig's; a checkpoint brings its own shape).
RANDOM_MODEL = {
    field.name: field.default for field in dataclasses.fields(ModelSection) if field.name not in ("path", "tokenizer")
}


@dataclasses.dataclass(frozen=True)
class UpdateSectionFields:
    """What a config section of an update counts in the user's units (the engine's: ``UpdateConfig``)."""

    ppo_mini_batch_size: int = 8  # PROMPTS per optimizer step (verl's convention); the engine gets x rollout.n


@dataclasses.dataclass(frozen=True)
class ActorSection(ActorFields, UpdateSectionFields):
    """The policy update (:class:`~jppo.engine.config.ActorFields`). ``lora``: train low-rank adapters on the
    policy's projections instead of all its weights (:class:`~jppo.models.lora.LoRAConfig`; ``rank: 0``, the
    default, trains everything)."""

    # the PPO ratio's old log-probs: recompute (a forward pass before the update), rollout (the sampler's), auto (the
    # update's own, stop-gradient, when it is on-policy: one epoch over one mini-batch; else recompute)
    old_log_prob: str = "auto"
    # routing replay of a model with experts (verl's routing_replay): none, or rollout (R3): the sampler records each
    # token's experts per layer and the policy's forward passes (old log-probs, the update) route by them, the
    # router's probabilities renormalized over them (docs/algorithms.md)
    routing_replay: str = "none"
    lora: LoRAConfig = dataclasses.field(default_factory=LoRAConfig)


@dataclasses.dataclass(frozen=True)
class CriticSection(CriticFields, UpdateSectionFields):
    """The critic: a value head on the policy's backbone (initialised from the policy checkpoint, as verl does).
    ``enable: null`` builds it only when ``algorithm.adv_estimator`` needs one (gae)."""

    enable: Optional[bool] = None  # build and train a critic; None: only when algorithm.adv_estimator needs one
    # a Hugging Face checkpoint of the critic: its decoder, and its value head if it has score.weight (else a new
    # head); None: model.path, or without one a copy of the random policy's decoder
    model_path: Optional[str] = None
    # adapters on the critic's backbone, new head trained
    lora: LoRAConfig = dataclasses.field(default_factory=LoRAConfig)


@dataclasses.dataclass(frozen=True)
class RefSection:
    """The reference policy for KL terms, kept only when a KL term needs it. ``model_path`` defaults to the
    policy's initial weights. ``param_dtype``: the reference never trains, so its weights are kept in the compute
    dtype by default (``model.dtype``: bfloat16 halves a float32 copy); the norm scales, which the model reads in
    float32, keep ``model.param_dtype``, so its log-probs are those of a copy kept in ``model.param_dtype``. With
    LoRA and no ``model_path`` the reference is the policy's frozen base, read in place (no copy, no cast)."""

    model_path: Optional[str] = None  # a Hugging Face checkpoint; None: the policy's initial weights (LoRA: its base)
    param_dtype: Optional[str] = None  # dtype its weights are kept in (it never trains); None: model.dtype


@dataclasses.dataclass(frozen=True)
class VLLMSection:
    """``rollout.vllm``: what ``vllm.LLM`` is started with (read only with ``rollout.engine: vllm``, refused when set
    with ``jppo``; :mod:`jppo.rollout.vllm_engine`)."""

    gpu_memory_utilization: float = 0.1  # share of accelerator memory vLLM reserves (CPU build: of host memory); (0, 1]
    kv_cache_memory_bytes: int = 0  # KV cache bytes, instead of what gpu_memory_utilization leaves; 0: derived
    enforce_eager: bool = False  # no torch.compile / CUDA graphs: starts in seconds, decodes slower on accelerators
    max_num_seqs: int = 0  # sequences vLLM decodes at once; 0: vLLM's default
    enable_prefix_caching: bool = True  # a prompt's KV blocks are computed once for its rollout.n rows
    # vLLM in servers of its own (jppo.rollout.vllm_remote); neither: vLLM in the training process
    num_servers: int = 0  # servers this run starts on this host (python -m jppo.serve), each a process of its own
    servers: tuple[str, ...] = ()  # ["host:port", ...] of servers started by hand (python -m jppo.serve) anywhere
    # the servers' GPUs are never the trainer's: JAX in the run uses the others (jppo.rollout.vllm_server.split_gpus)
    gpus: tuple[int, ...] = ()  # each started server's GPU (ordinals of those the run sees); empty: the last ones
    timeout_s: float = 600.0  # a server that does not join, take a weight push or answer a request in this is an error
    bucket_bytes: int = 256 << 20  # a weight push streams its tensors in buckets of at most this many bytes

    def check(self) -> None:
        """:class:`InvalidSetting` naming the first option vLLM would refuse."""
        if not 0 < self.gpu_memory_utilization <= 1:
            raise InvalidSetting("", "gpu_memory_utilization", self.gpu_memory_utilization, "in (0, 1]")
        if self.kv_cache_memory_bytes < 0:
            raise InvalidSetting("", "kv_cache_memory_bytes", self.kv_cache_memory_bytes, ">= 0 (0: derived)")
        if self.max_num_seqs < 0:
            raise InvalidSetting("", "max_num_seqs", self.max_num_seqs, ">= 0 (0: vLLM's default)")
        if self.num_servers < 0:
            raise InvalidSetting("", "num_servers", self.num_servers, ">= 0 (0: vLLM in the training process)")
        if self.num_servers and self.servers:
            raise InvalidSetting("", "num_servers", self.num_servers, "0 when rollout.vllm.servers lists servers "
                                 "(the run starts servers, or reaches those started by hand: not both)")
        for address in self.servers:
            host, _, port = str(address).rpartition(":")
            if not host or not port.isdigit():
                raise InvalidSetting("", "servers", address, "a list of host:port")
        if self.gpus and len(self.gpus) != self.num_servers:  # vLLM's in-place reload reads its own process's
            # tensors: a server is one process on one GPU (tensor-parallel workers would be other processes)
            raise InvalidSetting("", "gpus", list(self.gpus), f"one GPU per server: {self.num_servers} "
                                 "(rollout.vllm.num_servers, or rollout.devices)")
        if self.timeout_s <= 0:
            raise InvalidSetting("", "timeout_s", self.timeout_s, "> 0")
        if self.bucket_bytes < 1 << 20:
            raise InvalidSetting("", "bucket_bytes", self.bucket_bytes, ">= 1048576 (1 MiB)")


@dataclasses.dataclass(frozen=True)
class RolloutSection:
    """Sampling with the KV-cache sampler. ``n`` responses per prompt; validation samples ``val_n`` per prompt
    at ``val_temperature`` (0: greedy). Prompt lengths are padded up to a multiple of ``prompt_bucket`` tokens so
    the sampler compiles once per bucket. ``dtype`` is the sampler's compute dtype (default: ``model.dtype``);
    ``bfloat16`` sampling against float32 training is the rollout/trainer mismatch that
    ``actor.rollout_correction`` corrects and its ``rollout_corr/*`` metrics show.

    ``max_num_seqs``: rows the sampler decodes at once (0: all of a batch), over all its devices: each decodes
    ``max_num_seqs / shards`` of its own (a multiple of the shards, ``config.devices.check_slots``). Fewer rows
    than the batch turns on continuous batching: a row that ends hands its slot to the next waiting row, so no
    decoding step is spent on finished rows (responses with a long tail of lengths), at a cost in parallelism per
    step; each row's tokens are the same either way (:mod:`jppo.rollout.decode`).

    ``cache_blocks``: the response cache is stored in up to this many blocks, and a decoding step skips the blocks
    no row has reached yet, at the cost of a conditional per block (after the first), layer and token. On GPU a
    conditional waits for its predicate on the host, so ``auto`` takes one block there; on a TPU one too (its
    decoding kernel skips the tiles no row sees by itself); 8 on CPU (:data:`jppo.models.kv_cache.CACHE_BLOCKS`).
    The same block count gives the same samples bit for bit; another changes log-probs by float rounding only.

    ``env``: a multi-turn environment (``builtin:calculator``, ``path/to/file.py:make_env`` or
    ``package.module:make_env``, see :mod:`jppo.rollout.env`); each response then alternates up to ``max_turns``
    model turns with the environment's observations, which are attended but masked out of every loss.

    ``engine``: what samples every response (training, validation, ``jppo.eval``, ReMax's baselines, DAPO's
    extra batches, multi-turn turns): ``jppo``, the KV-cache sampler above (the reference: it runs the trainer's
    model function), or ``vllm``, one vLLM engine per process started from the policy's Hugging Face config with
    ``vllm``'s options, the policy's weights pushed into it after every update (:mod:`jppo.rollout.vllm_engine`).
    With ``vllm`` the keys ``prompt_bucket`` (shapes only), ``dtype`` and sampling keys keep their meaning;
    ``max_num_seqs`` and ``cache_blocks`` are jppo's sampler's, refused with ``vllm`` when set (vLLM's is
    ``vllm.max_num_seqs``; it pages its own cache), and ``vllm``'s keys are refused with ``jppo``.

    ``devices``: N > 0 gives the sampler a mesh of its own, the last N of the run's devices (the first ones form the
    training mesh, shaped by ``mesh``): the policy's weights move to it after every update, in the rollout dtype,
    and with ``trainer.off_policy_steps`` >= 1 the next rollout runs there while the update trains (one process,
    ``engine: jppo``; ``docs/scale-out.md``)."""

    n: int = 1  # responses sampled per training prompt (a GRPO group)
    temperature: float = 1.0  # training rollouts' logits are divided by it (> 0); log-probs use the same T
    top_k: int = 0  # sample among the k most likely tokens only; 0: no top-k filter
    top_p: float = 1.0  # sample from the smallest set of tokens whose probability reaches p; 1.0: no filter
    max_response_length: int = 16  # most tokens sampled per response (prompt excluded); a longer one is cut there
    prompt_bucket: int = 16  # prompts are padded to a multiple of this many tokens (one compilation per bucket)
    val_n: int = 1  # responses sampled per validation prompt
    val_temperature: float = 0.0  # validation's sampling temperature; <= 0: greedy (no top-k/top-p either way)
    log_prob_micro_batch_size: Optional[int] = None  # sequences per shard in forward passes; default: actor's
    dtype: Optional[str] = None  # the sampler's compute dtype; default: model.dtype
    env: Optional[str] = None  # multi-turn environment factory; None: single-turn
    max_turns: int = 4  # model turns per response with an env
    max_num_seqs: int = 0  # rows decoded at once; 0: every row of the batch (continuous batching below that)
    cache_blocks: str = "auto"  # response-cache blocks: auto (1 on GPU and TPU, 8 on CPU) | an integer N >= 1
    # what samples: jppo (its own sampler) or vllm (its install: README, Train a Hugging Face model)
    engine: str = "jppo"
    devices: int = 0  # the rollout's own devices (each process's last N / P; vllm: N servers); 0: the training mesh
    vllm: VLLMSection = dataclasses.field(default_factory=VLLMSection)  # rollout.engine=vllm's start-up options


@dataclasses.dataclass(frozen=True)
class KLControlSection:
    type: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.001  # coefficient of the KL in the reward; adaptive: its initial value
    target_kl: float = 0.1  # adaptive: the KL (token mean per response, averaged) the coefficient steers to (> 0)
    horizon: int = 10000  # adaptive: responses over which the coefficient moves by the KL's clipped relative error


@dataclasses.dataclass(frozen=True)
class FilterGroupsSection:
    """DAPO's dynamic sampling (:mod:`jppo.run.filters`): prompt groups whose ``rollout.n`` responses all
    have the same ``metric`` (``reward``: the training reward, overlong shaping included; ``score``: without it)
    are dropped, and prompt batches are sampled until ``data.train_batch_size`` prompts are kept. More than
    ``max_num_gen_batches`` batches in one step (0: no limit) stops the run with an error, as verl does."""

    enable: bool = False  # drop the prompt groups whose responses all share one metric value (DAPO)
    metric: str = "reward"  # reward (the training reward, overlong shaping included) | score (without it)
    max_num_gen_batches: int = 0  # most prompt batches sampled in one step, else an error; 0: no limit


@dataclasses.dataclass(frozen=True)
class AlgorithmSection:
    """Advantages and KL in the reward (verl's ``algorithm`` section)."""

    adv_estimator: str = "gae"  # a name registered in jppo.advantages.ADVANTAGE_ESTIMATORS (gae, grpo, rloo, ...)
    gamma: float = 1.0  # discount per token of gae and reinforce_plus_plus (1.0: none)
    lam: float = 1.0  # GAE's lambda: 1.0 gives Monte Carlo returns minus values, 0 one-step TD errors
    norm_adv_by_std_in_grpo: bool = True  # grpo, grpo_passk: divide by the group's score std; False: Dr. GRPO
    use_kl_in_reward: bool = False  # subtract kl_ctrl's coefficient x the KL to the reference from token rewards
    kl_penalty: str = "kl"  # the KL estimator of the reward penalty (jppo.losses.kl.KL_KINDS: kl, abs, mse, ...)
    kl_ctrl: KLControlSection = dataclasses.field(default_factory=KLControlSection)
    # DAPO's overlong filtering: responses cut by rollout.max_response_length before they ended are masked out of
    # the update's losses (they still count in their group's advantage baseline); the normalizers then count the
    # kept tokens only. A multi-turn episode ended by the environment or by rollout.max_turns is not cut.
    overlong_filter: bool = False
    filter_groups: FilterGroupsSection = dataclasses.field(default_factory=FilterGroupsSection)


@dataclasses.dataclass(frozen=True)
class MeshSection:
    """Mesh shape; one axis may be -1 (the remaining devices). Batch rows shard over data x fsdp x expert, the tokens
    of each packed row of the updates and log-prob/value passes over sequence (the sampler's rows over every one of
    these axes); a mixture's experts over expert."""

    data: int = -1  # devices along the data axis (replicas of the parameters, rows of the batch); -1: the rest
    fsdp: int = 1  # devices along the fsdp axis: rows of the batch and shards of the parameters
    tensor: int = 1  # devices along the tensor axis: shards of the hidden, head and vocabulary dimensions
    sequence: int = 1  # devices along the sequence axis (context parallelism): contiguous blocks of each row's tokens
    # devices along the expert axis (expert parallelism): a mixture's experts split among them, must divide
    # model.num_experts; rows of the batch elsewhere, as data splits them
    expert: int = 1


@dataclasses.dataclass(frozen=True)
class SFTSection:
    """Supervised fine-tuning (``python -m jppo.sft``, :mod:`jppo.run.sft`): each training step is one optimizer step
    on ``batch_size`` rows, cut into micro-batches and normalized as the actor's update is (``actor``'s
    ``ppo_micro_batch_size``, ``use_dynamic_bsz``, ``ppo_max_token_len``, ``loss_agg_mode``, ``optim`` and ``lora``).

    A row of ``train_files`` / ``val_files`` (JSONL or Parquet) is a ``prompt_key`` / ``completion_key`` pair (the
    prompt tokenized as the trainer tokenizes prompts, ``data.apply_chat_template`` included; the loss on the
    completion and its EOS) or a ``messages_key`` list of ``{role, content}`` chat messages rendered with the
    tokenizer's chat template (the loss on every assistant turn). Without ``train_files`` the rows are
    demonstrations of ``data.task``: its prompts with their answers as completions (the held-out ones from its
    validation split)."""

    train_files: Any = None  # JSONL/Parquet rows (Files); None: demonstrations of data.task
    val_files: Any = None  # held-out rows, given as train_files is; None: data.task's validation split (if a task)
    prompt_key: str = "prompt"  # a row's prompt column
    completion_key: str = "completion"  # a row's completion column (the tokens the loss counts)
    messages_key: str = "messages"  # a row's chat column: {role, content} messages; used when a row has it
    max_length: int = 64  # most tokens of a row (prompt + completion, or the rendered chat); a longer row is an error
    batch_size: int = 32  # rows per optimizer step (one training step)


# trainer.off_policy_steps' bound: the staleness a batch may have, and the weight copies a run holds for it
MAX_OFF_POLICY_STEPS = 4


@dataclasses.dataclass(frozen=True)
class TrainerSection:
    """The loop. ``val_every`` steps (0: never) and, with ``val_before_train``, once before the first step, the
    policy is validated on held-out prompts (``rollout.val_*``); the latter is logged at step 0, as verl logs it at
    global step 0, and is not repeated when a run resumes.

    ``logger``: where metrics go (:data:`jppo.runlog.SINKS`: console, jsonl, tensorboard, wandb); ``wandb`` needs the
    optional package and names its run ``project_name`` / ``experiment_name`` (default: the output directory's
    name). ``progress_bar``: on a terminal, the console shows a bar rather than summary lines. At each validation,
    the first ``log_val_generations`` responses (prompt, response, reward, finished) are logged too."""

    total_steps: int = 100  # training steps of the run (one batch of data.train_batch_size prompts each)
    output_dir: str = "runs/default"  # checkpoints, metrics, plots and exports: a local folder or a gs:// URI
    seed: int = 0  # seeds the random initial model, the prompt order, sampling and mini-batch shuffles
    save_every: int = 0  # training steps between checkpoints; 0: only at the end
    resume: str = "auto"  # auto (output_dir's latest checkpoint, if any) | never | PATH (that checkpoint)
    max_checkpoints_to_keep: int = 2  # the newest checkpoints kept in output_dir/checkpoints; older ones are deleted
    async_checkpoint: bool = True  # write checkpoints in the background, committed once written; false: block
    val_every: int = 0  # training steps between validations on held-out prompts; 0: no validation
    val_before_train: bool = False  # validate once before the first step (logged at step 0, not on resume)
    export_hf: bool = False  # at the end, write the policy as a Hugging Face checkpoint to output_dir/hf
    # where metrics go, sinks of jppo.runlog.SINKS (console, jsonl, tensorboard, wandb: needs the optional package)
    logger: list[str] = dataclasses.field(default_factory=lambda: ["console", "jsonl", "tensorboard"])
    project_name: str = "jppo"  # the wandb project
    experiment_name: Optional[str] = None  # the wandb run's name; None: the output directory's name
    log_val_generations: int = 16
    progress_bar: bool = True
    plots: bool = True  # at the end, the main process draws the run's metrics into output_dir (jppo.runlog.plot)
    critic_warmup: int = 0  # first training steps that update only the critic (the policy stays as it is)
    # auto | off (also none, null) | an absolute FOLDER: the persistent XLA cache (jppo.parallel.compile_cache)
    compilation_cache: Optional[str] = "auto"
    # k in [0, 4]: each step's batch sampled by the weights of min(step - 1, k) updates before, the next batch
    # generated while this step trains (jppo.run.offpolicy, docs/scale-out.md); 0: on-policy, collect then learn
    off_policy_steps: int = 0
    # off | bitwise: the run's metrics and checkpoints the same bits on 1, 2, 4 or 8 devices and under any cut, and
    # the sampler's log-probs the trainer's, at a price in speed (docs/contract.md, "Bit for bit")
    deterministic: str = "off"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    actor: ActorSection = dataclasses.field(default_factory=ActorSection)
    critic: CriticSection = dataclasses.field(default_factory=CriticSection)
    ref: RefSection = dataclasses.field(default_factory=RefSection)
    rollout: RolloutSection = dataclasses.field(default_factory=RolloutSection)
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    algorithm: AlgorithmSection = dataclasses.field(default_factory=AlgorithmSection)
    mesh: MeshSection = dataclasses.field(default_factory=MeshSection)
    trainer: TrainerSection = dataclasses.field(default_factory=TrainerSection)
    sft: SFTSection = dataclasses.field(default_factory=SFTSection)  # python -m jppo.sft's data and batch

    @property
    def use_critic(self) -> bool:
        if self.critic.enable is not None:
            return self.critic.enable
        from jppo.advantages import ADVANTAGE_ESTIMATORS  # noqa: PLC0415 (the registry; the schema stands alone)

        return ADVANTAGE_ESTIMATORS[self.algorithm.adv_estimator].needs_critic

    @property
    def use_reference(self) -> bool:
        return self.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    @property
    def roles(self) -> tuple[str, ...]:
        """The sections whose models the run updates."""
        return ("actor", "critic") if self.use_critic else ("actor",)
