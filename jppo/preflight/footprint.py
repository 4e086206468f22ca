"""The bytes of one device's arrays, the formulas of :mod:`jppo.preflight.memory`'s plan (its docstring has the table of
symbols): how the rule table shards an array, what a layer keeps per token for its backward pass (dense or blocked
attention, a row split over ``mesh.sequence``), one micro-batch's activations and logits, the weights a step
casts, the sampler's caches."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from typing import Optional, Sequence

from jppo.config import TrainConfig
from jppo.models.config import DTYPES, ModelConfig
from jppo.parallel.mesh import fitted_spec, sequence_shards

ACCUMULATOR_BYTES = 4  # float32 moments and accumulator (float64 only for float64 exactness tests)
LOGIT_COPIES = 3  # one chunk's logits, their softmax, and their gradient
SAMPLER_LOGIT_COPIES = 4  # a decoding step's logits, log-softmax, random bits and noised logits (compiled: TPU, GPU)


@dataclasses.dataclass(frozen=True)
class Term:
    """One line of the plan: bytes per device, and the formula that gave them."""

    name: str
    bytes: int
    formula: str


def shards(shape: Sequence[int], names: Sequence[Optional[str]], mesh: dict[str, int]) -> int:
    """Into how many pieces the rule table cuts an array of ``shape`` whose dimensions carry logical ``names``."""
    count = 1
    for axes in fitted_spec(shape, names, mesh):
        for axis in (axes,) if isinstance(axes, str) else (axes or ()):
            count *= mesh.get(axis, 1)
    return count


def local_elements(params, mesh: dict[str, int]) -> int:
    """``n``: the parameters one device holds, each tensor divided by its shards."""
    from flax import nnx  # noqa: PLC0415

    from jppo.models.sharding import logical_names  # noqa: PLC0415

    total = 0
    for _, variable in nnx.to_flat_state(params):
        total += math.prod(variable.shape) // shards(variable.shape, logical_names(variable), mesh)
    return total


def split(size: int, mesh: dict[str, int]) -> int:
    """``size`` over ``mesh.tensor`` when it divides it (the rule table leaves it whole otherwise)."""
    return size // mesh["tensor"] if size % mesh["tensor"] == 0 else size


def dtype_bytes(name: str) -> int:
    return DTYPES[name].itemsize


def planned_attention(m: ModelConfig, width: int, platform: str) -> str:
    """The implementation attention over rows of ``width`` tokens runs on ``platform``: ``auto`` as
    :func:`~jppo.models.layers.resolve_attention` resolves it there (splash attention on a TPU at every length; on a
    GPU cuDNN below :data:`~jppo.models.layers.AUTO_LONG_ROW` tokens and Triton's kernel from there; elsewhere blocks
    from that length on), any other name as it is."""
    from jppo.models.layers import resolve_attention  # noqa: PLC0415

    return resolve_attention(m.attention, m.compute_dtype, platform, width)


def linear_attention(m: ModelConfig, width: int, platform: str = "cpu") -> bool:
    """Whether attention over rows of ``width`` tokens keeps no dense ``[w, w]`` scores: it runs in blocks
    (``blockwise`` or ``pallas``) or in cuDNN's fused kernel (:func:`planned_attention`)."""
    from jppo.models.layers import RULE_ONLY  # noqa: PLC0415

    return planned_attention(m, width, platform) in (*RULE_ONLY, "cudnn")


def attention_kernel(m: ModelConfig, width: int, platform: str) -> bool:
    """Whether attention over rows of ``width`` tokens runs in a fused kernel on ``platform`` (``pallas``: splash
    on a TPU, Triton on a GPU; ``cudnn``), whose scores never reach the device's memory (off an accelerator Pallas
    runs in interpret mode, in memory)."""
    return platform in ("tpu", "gpu") and planned_attention(m, width, platform) in ("pallas", "cudnn")


def expert_group(m: ModelConfig, mesh: dict[str, int]) -> int:
    """``e``: the devices of the ``expert`` axis whose tokens a layer with experts gathers (1 where the axis does
    not divide the experts, or is 1)."""
    e = mesh.get("expert", 1)
    return e if e > 1 and m.num_experts % e == 0 else 1


def in_rounds(m: ModelConfig, tokens: int) -> bool:
    """Whether a layer with experts over ``tokens`` local tokens exchanges them in rounds of
    ``model.expert_chunk_size`` (:func:`jppo.models.exchange.in_rounds`)."""
    return 0 < m.expert_chunk_size < tokens


def exchange_round_bytes(m: ModelConfig, mesh: dict[str, int], tokens: int, backward: bool) -> int:
    """One round of the experts' exchange when it runs in rounds (else 0), held once whatever the layer count
    (the rounds run one at a time, each recomputed in the backward pass): the group's ``e C`` gathered tokens of
    ``C = model.expert_chunk_size`` with their weights and experts, and their ``e C k`` pairs' rows and
    intermediates, ``e C (c (d + 2 k) + k P)`` (``P``: :func:`pair_bytes`)."""
    if not in_rounds(m, tokens):
        return 0
    c, d = dtype_bytes(m.dtype), m.hidden_size
    e, k = expert_group(m, mesh), m.num_experts_per_tok
    return e * m.expert_chunk_size * (c * (d + 2 * k) + k * pair_bytes(m, mesh, backward))


# Copies of a layer's rows expanded over its experts that XLA:GPU holds at once in a forward and a backward pass
# (Qwen3-30B-A3B compiled for h200x8: one bf16[32768, 32, 2048] slot in the old log-probs' pass, three in the update)
GPU_EXPANDED_COPIES = {False: 1, True: 3}


def expanded_rows_bytes(m: ModelConfig, mesh: dict[str, int], tokens: int, backward: bool, platform: str) -> int:
    """XLA:GPU's grouped product (``jax.lax.ragged_dot``): it computes every (token, expert) pair of a layer's
    exchange (a round's ``e C k``, else ``e n k`` of the pass's ``n`` = ``tokens``) against each of the device's
    ``E / e`` experts, the rows masked to their expert's group, in buffers of ``[pairs, E / e, max(D, F_e)]`` in the
    compute dtype (:data:`GPU_EXPANDED_COPIES` of them); 0 elsewhere (XLA:TPU's kernel reads the sorted rows)."""
    if platform != "gpu" or not m.sparse_layers:
        return 0
    e, k = expert_group(m, mesh), m.num_experts_per_tok
    pairs = e * k * (m.expert_chunk_size if in_rounds(m, tokens) else tokens)
    width = max(m.hidden_size, split(m.moe_intermediate_size, mesh))
    return GPU_EXPANDED_COPIES[backward] * pairs * m.num_experts // e * width * dtype_bytes(m.dtype)


def pair_bytes(m: ModelConfig, mesh: dict[str, int], backward: bool) -> int:
    """What a layer with experts holds for one (token, expert) pair of its exchange. A backward pass keeps the
    sorted row, the expert's gate, up and gated intermediates of ``F_e`` (``moe_intermediate_size``) and its
    output row, sorted and unsorted: ``c (3 D + 3 F_e)``. A forward pass holds at most the sorted row and the gate
    and up products together, ``c (D + 2 F_e)`` (XLA:TPU's buffer assignment of the old log-probs' pass and the
    prefill at d 256, F_e 512: the gated product then takes the gate's place, and the output row the rows')."""
    c, d, f = dtype_bytes(m.dtype), m.hidden_size, split(m.moe_intermediate_size, mesh)
    return c * (3 * d + 3 * f) if backward else c * (d + 2 * f)


def mixture_bytes_per_token(m: ModelConfig, mesh: dict[str, int], backward: bool, tokens: int = 0) -> int:
    """What the mixture of a layer with experts holds per local token (:func:`jppo.models.moe.expert_parallel`):
    the router's float32 logits and probabilities over the ``E`` experts; the group's gathered tokens, ``e`` per
    local token, with their weights and experts; and what each of their ``k`` (token, expert) pairs holds,
    ``P`` (:func:`pair_bytes`): ``2 a E + e c (d + 2 k) + e k P``. The exchange's buffers grow with the group,
    ``e n k`` pairs on each device.
    Compiled for v5p:2x2x2 (quickstart_moe widened: d 256, F_e 512, every layer with experts; mesh data 8 with
    k = 2 and 8, expert 8 with k = 8; ``tests/test_compile_for.py``), every program is planned within 10% of the HBM
    of XLA's buffer assignment on rows of 256 tokens with splash attention. On the quickstart's 13-token rows
    (reference attention) the updates are at 0.93, 0.98 and 1.00 of it, the old log-probs at 1.40, 1.08 and 0.99
    (at k = 2 XLA holds a layer's sliced experts in the core's VMEM), the rollouts at 0.89, 0.85 and 0.78 (the
    caches' 5 slots padded to the TPU's 8, and held twice at the decoding loop's start).

    Exchanged in rounds (``tokens``, the layer's local tokens, above ``model.expert_chunk_size``), a layer keeps
    per token only the router's terms and its own token, weights and experts, ``2 a E + c (d + 2 k)``; the round's
    working set is :func:`exchange_round_bytes`. Compiled as above at k = 8 on expert 8 (832 local tokens, rounds
    of 128), the update fell from 1.03 GiB to 161.5 MiB, the old log-probs' pass from 292.2 to 66.3 MiB."""
    c, a, d = dtype_bytes(m.dtype), ACCUMULATOR_BYTES, m.hidden_size
    e, k = expert_group(m, mesh), m.num_experts_per_tok
    if in_rounds(m, tokens):
        return 2 * a * m.num_experts + c * (d + 2 * k)
    return 2 * a * m.num_experts + e * c * (d + 2 * k) + e * k * pair_bytes(m, mesh, backward)


def layer_bytes_per_token(m: ModelConfig, width: int, mesh: dict[str, int], platform: str = "gpu",
                          sparse: bool = False, tokens: int = 0) -> int:
    """``x``: what one layer keeps for its backward pass per token of a row of ``width`` (module docstring). Dense
    attention keeps its float32 scores and probabilities and the probabilities cast back (``2 a + c`` a score); the
    backward pass XLA:GPU compiles also holds the probabilities' float32 gradient beside them and the mask
    broadcast over the heads (``3 a + c + 1``; XLA:TPU fuses both away. Compiled: Qwen2.5 shapes, v5p and H100).
    XLA:CPU (``platform="cpu"``, the tests' compiles) keeps no more than XLA:TPU: with the GPU's terms the
    quickstart SFT update of 32 rows is planned 13% above its compiled bytes, with the TPU's 6%."""
    c, a = dtype_bytes(m.dtype), ACCUMULATOR_BYTES
    heads, d = split(m.num_heads, mesh), m.hidden_size
    q, kv, f = heads * m.head_dim, split(m.num_kv_heads, mesh) * m.head_dim, split(m.intermediate_size, mesh)
    if linear_attention(m, width, platform):
        attention = a * heads  # the log-sum-exp of each query head, all the blocked backward pass keeps
    else:
        attention = (2 * a + c + (a + 1 if platform == "gpu" else 0)) * heads * width
    gathered = 2 * (row_split(width, mesh) - 1) * kv * c  # the row's other keys and values, per local token
    mlp = mixture_bytes_per_token(m, mesh, backward=True, tokens=tokens) if sparse else 4 * c * f
    return c * (4 * d + 3 * q + 3 * kv) + mlp + a * (2 * d + q + kv) + attention + gathered


def layer_kinds(m: ModelConfig) -> tuple[tuple[bool, int], ...]:
    """``(sparse, count)`` of the model's layers: those with experts and the dense ones (a kind with none left
    out)."""
    sparse = len(m.sparse_layers)
    return tuple((kind, count) for kind, count in ((True, sparse), (False, m.num_layers - sparse)) if count)


def forward_layer_bytes_per_token(m: ModelConfig, width: int, mesh: dict[str, int], platform: str = "gpu",
                                  tokens: int = 0) -> int:
    """What one layer of a forward pass that keeps nothing for a backward pass (log-probs, values, the sampler's
    prefill) holds at once per token of a row of ``width``: its input and output hidden states, the queries, keys
    and values, and the larger of attention's float32 scores (over the whole row when dense, over one key block
    when blocked) and the MLP's three intermediates. On a GPU the softmax's probabilities in the compute dtype lie
    beside the scores; XLA:TPU fuses them into their product with the values (compiled: Qwen2.5 shapes, v5p and
    H100). ``tokens``: the pass's local tokens, over which an exchange in rounds spreads its one round's working
    set."""
    c, a = dtype_bytes(m.dtype), ACCUMULATOR_BYTES
    a += 0 if platform == "tpu" else c
    heads, d = split(m.num_heads, mesh), m.hidden_size
    q, kv, f = heads * m.head_dim, split(m.num_kv_heads, mesh) * m.head_dim, split(m.intermediate_size, mesh)
    # scores over the whole row when dense, over one key block in blocks, none in memory in a kernel (on the chip)
    if attention_kernel(m, width, platform):
        keys = 0
    elif linear_attention(m, width, platform):
        keys = min(m.attention_block_kv, width)
    else:
        keys = width
    mlp = 3 * c * f if m.dense_layers else 0
    if m.sparse_layers:
        mixture = mixture_bytes_per_token(m, mesh, backward=False, tokens=tokens)
        once = exchange_round_bytes(m, mesh, tokens, False) + expanded_rows_bytes(m, mesh, tokens, False, platform)
        mlp = max(mlp, mixture + once // max(tokens, 1))
    return c * (2 * d + q + 2 * kv) + max(a * heads * keys, mlp)


def row_split(width: int, mesh: dict[str, int]) -> int:
    """``q``: into how many blocks ``mesh.sequence`` splits a row of ``width`` tokens (1 where it does not divide:
    the rule table then leaves the row whole)."""
    shards = sequence_shards(mesh)
    return shards if width % shards == 0 else 1


def attention_block_bytes(m: ModelConfig, rows: int, width: int, mesh: dict[str, int], platform: str = "cpu") -> int:
    """``b``: blocked attention's working set, one block pair's scores and probabilities at a time (0 for dense
    attention, whose scores are in ``x``)."""
    if not linear_attention(m, width, platform):
        return 0
    c, a, heads = dtype_bytes(m.dtype), ACCUMULATOR_BYTES, split(m.num_heads, mesh)
    local = width // row_split(width, mesh)
    return (2 * a + c) * rows * heads * min(m.attention_block_q, local) * min(m.attention_block_kv, width)


def activation_bytes(m: ModelConfig, rows: int, width: int, mesh: dict[str, int], platform: str = "gpu") -> int:
    """Activations one micro-batch of ``rows x width`` tokens keeps on one device for its backward pass."""
    local = width // row_split(width, mesh)
    tokens = rows * local
    per_layer = {kind: layer_bytes_per_token(m, width, mesh, platform, kind, tokens) for kind, _ in layer_kinds(m)}
    if m.remat:
        kept, recomputed = dtype_bytes(m.dtype) * m.hidden_size * m.num_layers, max(per_layer.values())
    else:
        kept, recomputed = sum(count * per_layer[kind] for kind, count in layer_kinds(m)), 0
    rounds = exchange_round_bytes(m, mesh, tokens, backward=True) if m.sparse_layers else 0
    rounds += expanded_rows_bytes(m, mesh, tokens, True, platform)
    return tokens * (kept + recomputed) + attention_block_bytes(m, rows, width, mesh, platform) + rounds


def kept_activation_bytes(m: ModelConfig, rows: int, width: int, mesh: dict[str, int], platform: str = "gpu") -> int:
    """What all layers keep for the backward pass (``r (w / q) L s``) without the layer recomputed at a time."""
    tokens = rows * (width // row_split(width, mesh))
    if m.remat:
        kept = dtype_bytes(m.dtype) * m.hidden_size * m.num_layers
    else:
        kept = sum(count * layer_bytes_per_token(m, width, mesh, platform, kind, tokens)
                   for kind, count in layer_kinds(m))
    return tokens * kept


def logits_bytes(m: ModelConfig, rows: int, width: int, chunk_size: int, mesh: dict[str, int]) -> int:
    local = width // row_split(width, mesh)
    return LOGIT_COPIES * rows * min(chunk_size, local) * split(m.vocab_size, mesh) * ACCUMULATOR_BYTES


def layer_weights_bytes(m: ModelConfig, mesh: dict[str, int]) -> int:
    """The largest decoder layer's weights gathered in the compute dtype (its share of ``mesh.tensor``): attention
    and the dense MLP, or, in a layer with experts, the router and this device's ``num_experts / mesh.expert``
    experts."""
    d, f = m.hidden_size, m.intermediate_size
    mlp = 3 * d * f if m.dense_layers else 0
    if m.sparse_layers:
        groups = mesh.get("expert", 1) if m.num_experts % mesh.get("expert", 1) == 0 else 1
        mlp = max(mlp, d * m.num_experts + 3 * m.num_experts // groups * d * m.moe_intermediate_size)
    layer = d * (m.num_heads + 2 * m.num_kv_heads) * m.head_dim + m.num_heads * m.head_dim * d + mlp
    return layer // mesh["tensor"] * dtype_bytes(m.dtype)


# Bytes per table element the LM head's backward pass holds beyond the gathered table, where fsdp splits the table
# (compiled: Qwen2.5-0.5B's update, 4096-token rows, fsdp 8). On a GPU a chunk's gradient of the whole table in
# float32 before its reduce-scatter and the table in a second layout (XLA:GPU's memory-usage report: f32[896,151936]
# and bf16[896,151936] beside the gathered bf16[151936,896]); on a TPU also a third layout, the head gradient's
# bfloat16 all-reduce and a tied lookup's gradient scatter-added over the whole table (its HLO). In compute-dtype
# copies beside the float32 one: a + HEAD_TABLE_COPIES[platform] c.
HEAD_TABLE_COPIES = {"gpu": 1, "tpu": 4}


def head_copies_bytes(m: ModelConfig, mesh: dict[str, int], platform: str) -> int:
    """What the LM head's backward pass holds of the table beside its gathered copy (:data:`HEAD_TABLE_COPIES`):
    ``V' D (a + h c)`` on a GPU or TPU with ``mesh.fsdp > 1``, else 0 (unmeasured: the CPU's compiles and an
    unsplit table)."""
    if platform not in HEAD_TABLE_COPIES or mesh.get("fsdp", 1) == 1:
        return 0
    copies = ACCUMULATOR_BYTES + HEAD_TABLE_COPIES[platform] * dtype_bytes(m.dtype)
    return split(m.vocab_size, mesh) * m.hidden_size * copies


def table_bytes(m: ModelConfig, mesh: dict[str, int]) -> int:
    """The embedding table (or untied LM head: its vocabulary share) gathered in the compute dtype."""
    return split(m.vocab_size, mesh) * m.hidden_size * dtype_bytes(m.dtype)


def weights_in_use_bytes(m: ModelConfig, mesh: dict[str, int]) -> int:
    """The embedding (its vocabulary share) and one layer's weights, gathered in the compute dtype."""
    return table_bytes(m, mesh) + layer_weights_bytes(m, mesh)


def kv_cache_bytes(m: ModelConfig, prompts: int, prompt_len: int, rows: int, length: int,
                   mesh: dict[str, int]) -> int:
    """The sampler's caches on one device for a model computing in ``m.dtype``: a
    :class:`~jppo.models.PromptCache` of ``prompts`` prompts of ``prompt_len`` slots (stored once for all samples
    of a prompt, plus its bool visibility mask) and a :class:`~jppo.models.ResponseCache` of ``rows`` rows (the
    rows decoded at once) of ``length`` slots."""
    keys_and_values = 2 * m.num_layers * split(m.num_kv_heads, mesh) * m.head_dim * dtype_bytes(m.dtype)
    # the caches' slots are whole on every device: decoding splits the rows over mesh.sequence, never a row's slots
    return prompts * prompt_len * (keys_and_values + 1) + rows * length * keys_and_values


def sampler_logits_bytes(m: ModelConfig, rows: int, mesh: dict[str, int], prompts: Optional[int] = None) -> int:
    """A decoding step's working set over the vocabulary for ``rows`` rows decoded at once: the float32 logits,
    their log-softmax (the drawn token's log-prob), the random bits and the noised logits of the categorical draw.
    With ``prompts``, a draw XLA fuses into the LM head's product (a TPU's unfiltered sampling,
    :func:`jppo.rollout.processors.one_pass_draw`): no decoding step holds the logits, only the first token's draw
    does, the ``prompts``' logits and their rows."""
    copies = SAMPLER_LOGIT_COPIES * rows if prompts is None else rows + prompts
    return copies * split(m.vocab_size, mesh) * ACCUMULATOR_BYTES


def model_config(cfg: TrainConfig, path: Optional[str] = None) -> ModelConfig:
    """The policy's architecture: ``config.json`` of ``path`` (default ``model.path``), else the config's own
    shape with the tokenizer's vocabulary. Only the config and tokenizer files are read."""
    from jppo.config import views  # noqa: PLC0415 (views imports the models; keep `--help` light)
    from jppo.data import load_tokenizer  # noqa: PLC0415
    from jppo.models import CheckpointError  # noqa: PLC0415

    path = path or cfg.model.path
    if path is None:
        return views.random_model_config(cfg, load_tokenizer(views.tokenizer_spec(cfg)))
    try:
        hf = json.loads((pathlib.Path(path) / "config.json").read_text())
        return ModelConfig.from_hf(hf, **views.checkpoint_overrides(cfg))
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path}/config.json: {error}") from None


def abstract_params(config: ModelConfig, head: str = "lm"):
    """The parameters of a ``CausalLM`` (``head="lm"``) or ``ValueModel`` (``"value"``) as shapes, no buffers."""
    from flax import nnx  # noqa: PLC0415

    from jppo.models import CausalLM, ValueModel  # noqa: PLC0415

    cls = {"lm": CausalLM, "value": ValueModel}[head]
    return nnx.state(nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0))), nnx.Param)


def adapter_params(config: ModelConfig, lora):
    """The LoRA adapters of a model of ``config`` as shapes (empty without LoRA)."""
    from flax import nnx  # noqa: PLC0415

    from jppo.models.lora import LoRAAdapters  # noqa: PLC0415

    if not lora.enabled:
        return nnx.State({})
    return nnx.state(nnx.eval_shape(lambda: LoRAAdapters(config, lora, rngs=nnx.Rngs(0))), nnx.Param)


def trained_elements(config: ModelConfig, role: str, lora, mesh: dict[str, int]) -> int:
    """``t``: the parameters ``role`` trains on one device: all of them, or its adapters (and a critic's new
    value head) with LoRA."""
    from flax import nnx  # noqa: PLC0415

    head = {"actor": "lm", "critic": "value"}[role]
    if not lora.enabled:
        return local_elements(abstract_params(config, head), mesh)
    extra = 0
    if role == "critic":
        extra = local_elements(nnx.state(nnx.eval_shape(lambda: _value_head(config)), nnx.Param), mesh)
    return local_elements(adapter_params(config, lora), mesh) + extra


def _value_head(config: ModelConfig):
    from flax import nnx  # noqa: PLC0415

    from jppo.models.value import ValueHead  # noqa: PLC0415

    return ValueHead(config, rngs=nnx.Rngs(0))


def human(size: int) -> str:
    """``size`` bytes as a person reads them: GiB, MiB or KiB with two decimals, else bytes."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.2f} {unit}"
    return f"{size} B"
