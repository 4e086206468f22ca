"""The memory plan (``python -m jppo.plan --config CFG [--devices N] [--json] [key.sub=value ...]``): the memory a
run needs on each device, computed from the config and the model's shapes before anything is allocated.

No weights are read (with ``model.path`` only its ``config.json``) and nothing is compiled: parameter shapes come
from ``nnx.eval_shape`` of the model, and each array is divided by the number of shards the one rule table
(:data:`jppo.parallel.mesh.LOGICAL_RULES`, through :func:`jppo.parallel.mesh.fitted_spec`) gives it on the mesh. The
mesh is the config's ``mesh.*`` on ``--devices`` devices (default: this machine's), so a plan can be made for another
machine.

Symbols: ``n`` a model's parameters on one device (each tensor divided by its shards: a mixture's experts by
``mesh.expert``), ``p`` / ``c`` / ``a`` the
bytes of the parameter, compute and accumulator (float32) dtypes, ``c_s`` those of the sampler's compute dtype
(``rollout.dtype``, default ``model.dtype``), ``V D F L H K E`` vocabulary, hidden size, MLP width, layers, query
heads, key-value heads, head size; ``H' K' F' V'`` those divided by ``mesh.tensor`` where it divides them (as the
rule table shards them). Bytes per device:

=====================  ====================================================================================
parameters             ``n p`` for the actor and the critic (when there is one); with LoRA (``actor.lora`` /
                       ``critic.lora``) ``(n + t) p``, ``t`` the adapters' elements. The reference (KL terms):
                       ``n_w r + n_s p``, its weights in ``r`` = the bytes of ``ref.param_dtype`` (default
                       ``model.dtype``), its norm scales in ``p``; none with LoRA (it reads the actor's frozen
                       base)
optimizer state        ``t a (2 + 1)``: AdamW's two moments and ``optax.MultiSteps``' gradient accumulator
                       (SGD: the accumulator only) of the ``t`` trained parameters (``t = n`` without LoRA; the
                       adapters, and a critic's value head, with it); no accumulator when every optimizer step
                       is one micro-batch (K = 1: ``t a 2``); a few scalar counters are left out
gradients              ``t p``: the gradient of one micro-batch, before it is added to the accumulator
weights in use         ``(V' D + one layer's weights / mesh.tensor) c``: the table (the actor's: in the head phase)
                       and the largest layer's weights (with experts: the router and ``num_experts / mesh.expert``
                       experts) cast to the compute dtype (and gathered over ``fsdp``) while they are used
layer gradient         ``one layer's weights / mesh.tensor x p``: in the backward pass, a layer's weight gradient
                       before it joins the stacked gradient (XLA:TPU's buffer assignment of a model with experts,
                       whose layers' weights outweigh their activations: quickstart_moe at d 256)
activations            ``r (w / q) (L s + x) + b`` for ``r`` rows of ``w`` tokens in one micro-batch, ``w / q`` of
                       them on each device (fixed: ``r = ppo_micro_batch_size``, ``w = bucket(max_prompt_length) +
                       max_response_length``; token budget: ``r = 1``, ``w = ppo_max_token_len``; ``q`` =
                       ``mesh.sequence``, which splits each row's tokens). ``x``: what a layer keeps for its backward
                       pass per token, ``c (4 D + 3 H'E + 3 K'E + 4 F') + a (2 D + H'E + K'E) + (2 a + c + g) H' w
                       + 2 (q - 1) K'E c`` (the third term: the unfused attention's scores and probabilities, ``w``
                       keys per query, and on a GPU (``g = a + 1``; 0 on a TPU) the probabilities' float32 gradient
                       and the mask broadcast over heads that XLA:GPU's backward pass holds; attention in blocks,
                       ``model.attention: blockwise | pallas`` or ``auto`` on long rows, keeps ``a H'`` instead,
                       its log-sum-exp, and works in ``b = (2 a + c) r H' min(b_q, w / q) min(b_kv, w)`` for one
                       block pair at a time, ``b_q``, ``b_kv`` its block sizes; ``b = 0`` otherwise; the last
                       term: the keys and values gathered from the other shards of the row); ``s = x`` without
                       remat, ``s = c D`` (the layer's input only) with ``model.remat``, then one layer is
                       recomputed at a time (``+ x``)
log-prob logits        ``3 r k V' a`` (actor only): the float32 logits of one chunk of ``k = min(
                       log_prob_chunk_size, w / q)`` positions, their softmax and their gradient, in the actor's
                       head phase: the LM head's backward pass, before the layers', beside the gradients, the kept
                       activations ``r (w / q) L s`` and the table ``V' D c`` (not a layer's working set)
head copies            ``V' D (a + h c)`` in the head phase on a GPU (``h = 1``) or TPU (``h = 4``) with ``mesh.fsdp >
                       1``: a chunk's float32 gradient of the whole table before its reduce-scatter and the table in
                       more layouts (:data:`~jppo.preflight.footprint.HEAD_TABLE_COPIES`; Qwen2.5-0.5B's update at
                       fsdp 8: 3.53 / 3.66 GiB plan / XLA on v5p:2x2x2 with them, 2.00 without; 3.41 XLA since
                       the optimizer left the micro-batch loop)
optimizer step         ``2 t a``: the temporaries of applying the accumulated gradient (the summed gradient and
                       the update; the new moments take the old ones' place): XLA's ``memory_analysis()`` of
                       the update reports ``2 n a`` of temporaries when the activations are small, with or
                       without an accumulator (Qwen2-shaped models on CPU, float32; ``tests/test_plan.py``).
                       Applied inside the micro-batch loop on its K-th turn it was ``4 n a``, and optax's
                       where-based ``apply_if_finite`` and ``MultiSteps.update`` made it 6-7 (see
                       :mod:`jppo.engine.optim`). On a GPU ``1.5 t a`` with an accumulator and ``t a``
                       without: XLA:GPU applies it nearly in place
KV cache               ``B P (2 L K' E c_s + 1) + S T 2 L K' E c_s``: the sampler's prompt cache (each prompt's
                       keys and values held once for its ``n`` samples, and a bool mask of its real tokens) and
                       response cache for ``B`` prompts and ``R = B n`` rows per device (``B = train_batch_size /
                       (data x fsdp x expert x sequence)``, the sampler's rows split over every batch axis, or the
                       validation batch in a phase of its own), of which ``S = min(rollout.max_num_seqs, R)`` are
                       decoded at once (``S = R`` when it is 0); ``P = bucket(max_prompt_length)``, ``T =
                       max_response_length``. With ``rollout.env`` every turn prefills each row's own context, which
                       grows to prompt + response: ``B = R = train_batch_size x n / (data x fsdp x expert x
                       sequence)``, ``P = bucket(max_prompt_length + T - 1)``
sampler logits         ``4 S V' a``: a decoding step's float32 logits of the ``S`` rows, their log-softmax (the
                       drawn token's log-prob), the categorical draw's random bits and noised logits (the four
                       ``[S, V']`` arrays of the compiled decoding step on GPU); ``(S + B) V' a`` on a TPU where the
                       draw is one pass (no filter, not greedy): XLA fuses it into the LM head, and only the first
                       token's draw holds the prompts' logits and their rows
prefill                ``B P y``: the prompts' forward pass that fills the caches, ``y`` what one layer of a forward
                       pass holds at once per token (hidden states in and out, queries, keys, values, and the larger
                       of attention's float32 scores and the MLP's three intermediates). Beside the caches and the
                       decoding step's logits, not instead of them: XLA's buffer assignment keeps them apart
table layout           ``V' D c_s`` on a TPU, for a tied embedding, in the validation batch's phase: XLA:TPU holds
                       the sampler's table in a second layout there, one for the lookup and one for the LM head's
                       product (compiled: Qwen2.5-0.5B on v5p:2x2x2), and not at the training rollout's peak since
                       a decoding step writes its cache slot in place (the rollout 0.47 GiB lower; the rollout's
                       plan 7% and 3% over XLA without the term at 0.5B and 1.5B, docs/compiling.md)
rollout weights        ``sum_w |w| / shards'(w) x (c_s, or p for the norms' scales)``: the sampler's copy of each
                       weight it casts to ``c_s`` or lays out anew (:func:`jppo.models.sharding.decoding_copy`):
                       replicated over ``data`` and ``fsdp`` (a decoding step's rows are split over them), split
                       over ``tensor`` as the rule table says (``shards'``). None where the parameters already are
                       that copy (``c_s = p`` and ``fsdp = 1``)
off-policy queue       ``k t p`` with ``trainer.off_policy_steps`` k >= 1: ``RunState.behind``, the weights the
                       next k batches are sampled with (copies of the actor's trained parameters; LoRA's frozen
                       base is shared), through the whole run; and ``t p`` more through each step's sampling and
                       updates, the copy of the weights before the update that the queue takes after it
=====================  ====================================================================================

The peak is what lives through the whole run (parameters, optimizer states, the off-policy queue) and through a
step (the off-policy copy) plus the largest of the phases that follow each other: sampling the training batch (its
KV cache and the sampler's weights), sampling the validation batch, a role's backward pass (its gradients, weights
in use, activations and logits) and its optimizer step. With k >= 1 on one device the next batch is sampled on a
thread beside the update (:func:`jppo.run.offpolicy.can_overlap`), so sampling and each update phase are live at
once: their sum, not the larger. Forward-only passes (old and reference log-probs, values) keep no activations for
a backward pass and stay below the update.

Per program (:func:`program_bytes`, what ``python -m jppo.plan --compile-for`` sets beside XLA's bytes): an update is
its role's parameters and optimizer state plus the larger of its backward pass and optimizer step; a forward pass
the weights it reads, their copy in the compute dtype when they are stored wider (XLA casts the stacked layers
once, outside the layer loop), one layer's weights in use, ``r w' y`` (one layer's forward working set over a
micro-batch, ``y`` as in the prefill line) and (log-probs) ``r k V' a`` of logits (XLA fuses their log-softmax
into that one array); the rollout and the validation the policy's parameters plus their sampling phase.

Against the compiled programs (``python -m jppo.plan --compile-for``, which prints both), with
``configs/qwen2_5_0_5b_gsm8k_grpo.yaml`` as shipped before 2026-12-07 (reference attention, 16384-token rows over
``sequence: 4``), plan / XLA GiB per device. Qwen2.5-0.5B's shape on v5p:2x2x2: actor update 13.79 / 14.33, old
log-probs 5.08 / 5.16, reference log-probs 4.16 / 4.06, rollout 2.85 / 3.11, validation 3.81 / 4.23; on h100x8: 18.17 /
18.08, 6.83 / 6.70, 5.91 / 6.00, 2.96 / 3.14, 4.23 / 4.04. Qwen2.5-7B's on v5p:4x4x4: 28.55 / 26.98, 10.33 / 11.02, 8.56
/ 8.07, 16.44 / 17.00, 16.94 / 17.46. As shipped since (``auto`` attention, whole 4096-token rows, fsdp 8): the actor
update 3.53 / 3.41 on v5p:2x2x2 and 2.76 / 2.64 on h100x8 (its peak the LM head's phase: ``head copies`` below),
the forward passes 0.95 / 0.67 of XLA on the TPU (0.86 / 0.82 on the GPU) and the TPU's validation 1.32 (not
modelled closer yet).
A forward pass's peak is one layer's float32 attention scores (3.5 GiB at 0.5B);
the prefill and the decoding step's logits are apart in XLA's buffer assignment, so both are counted. An update's
peak is one layer's attention backward pass (the optimizer step's temporaries are less). XLA:TPU pads each array's
two minor dimensions to its (8, 128) tiles, which dominates at toy sizes (the quickstart's 64-wide model). The
plan's platform (``gpu`` unless ``--compile-for`` names a TPU) decides what attention's softmax and the optimizer
step keep. The activation terms are an estimate
of what XLA keeps; ``bench/real_size.py`` compares the whole plan with a measured run.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from jppo.config import TrainConfig
from jppo.models.config import ModelConfig
from jppo.parallel.mesh import MESH_AXES, row_shards_of
from jppo.preflight.footprint import (
    ACCUMULATOR_BYTES,
    HEAD_TABLE_COPIES,
    LOGIT_COPIES,
    Term,
    abstract_params,
    activation_bytes,
    adapter_params,
    dtype_bytes,
    forward_layer_bytes_per_token,
    head_copies_bytes,
    kept_activation_bytes,
    layer_weights_bytes,
    linear_attention,
    local_elements,
    logits_bytes,
    model_config,
    row_split,
    table_bytes,
    trained_elements,
    weights_in_use_bytes,
)
from jppo.preflight.layout_copies import expert_layout_bytes, layout_copy_bytes
from jppo.preflight.sampler_memory import prompt_width, rollout_weights_term, sampler_terms

STEP_COPIES = 2  # per-parameter float32 temporaries of applying the summed gradient: it and the update (measured)
# XLA:GPU applies it nearly in place: 1.45 copies with an accumulator, 1.01 without (compiled for an H100, the model
# of tests/test_plan.py's step test, whose parameters dwarf its activations)
GPU_STEP_COPIES = {True: 1.5, False: 1}


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    mesh: dict[str, int]
    persistent: tuple[Term, ...]  # live through the whole run
    rollout: tuple[Term, ...]  # live while sampling
    updates: dict[str, tuple[Term, ...]]  # live during one phase of a role's update (backward, optimizer step)
    validation: tuple[Term, ...] = ()  # live while sampling the validation batch (when the run validates)
    in_flight: tuple[Term, ...] = ()  # live through a step's sampling and updates (off-policy: the weights before)
    concurrent: bool = False  # the next rollout is sampled beside the update (off-policy on one device)

    @property
    def persistent_bytes(self) -> int:
        return sum(term.bytes for term in self.persistent)

    @property
    def peak_bytes(self) -> int:
        phases = [self.rollout, self.validation, *self.updates.values()]
        if self.concurrent:
            phases = [self.validation, *(self.rollout + update for update in self.updates.values())]
        steps = self.persistent_bytes + sum(term.bytes for term in self.in_flight)
        return steps + max(sum(term.bytes for term in phase) for phase in phases)

    def term(self, name: str) -> int:
        """The bytes of the term called ``name`` (0 when the run has none; a term of two phases counted once)."""
        phases = (self.persistent, self.in_flight, self.rollout, self.validation, *self.updates.values())
        return max(sum(term.bytes for term in phase if term.name == name) for phase in phases)


# ---------------------------------------------------------------------------------------------------------------
# terms


def micro_batch_shape(cfg: TrainConfig, role: str) -> tuple[int, int]:
    """``(rows, width)`` of one micro-batch on one device for ``role``'s update."""
    section = getattr(cfg, role)
    if section.use_dynamic_bsz:
        return 1, section.ppo_max_token_len
    return section.ppo_micro_batch_size, prompt_width(cfg) + cfg.rollout.max_response_length


# ---------------------------------------------------------------------------------------------------------------
# the plan


def memory_plan(cfg: TrainConfig, mesh_shape: Sequence[int], platform: str = "gpu") -> MemoryPlan:
    """Bytes per device of every term of the module docstring for ``cfg`` on a mesh of ``mesh_shape`` of
    ``platform``'s devices (``"gpu"`` or ``"tpu"``: what a forward pass keeps of attention's softmax)."""
    mesh = dict(zip(MESH_AXES, mesh_shape))
    policy = model_config(cfg)
    p, a = dtype_bytes(policy.param_dtype), ACCUMULATOR_BYTES
    heads = {"actor": "lm", "critic": "value"}
    local = {role: local_elements(abstract_params(policy, heads[role]), mesh) for role in cfg.roles}
    lora = {role: getattr(cfg, role).lora for role in cfg.roles}
    adapters = {role: local_elements(adapter_params(policy, lora[role]), mesh) for role in cfg.roles}
    trained = {role: trained_elements(policy, role, lora[role], mesh) for role in cfg.roles}
    persistent = [
        Term(f"parameters/{role}", (n + adapters[role]) * p, f"n={n:,} + adapters t={adapters[role]:,} x p={p}"
             if adapters[role] else f"n={n:,} x p={p}")
        for role, n in local.items()
    ]
    if cfg.use_reference and not (cfg.actor.lora.enabled and not cfg.ref.model_path):  # LoRA: the frozen base
        persistent.append(reference_term(cfg, policy, mesh))
    accumulates = {role: accumulates_gradients(cfg, role, mesh) for role in cfg.roles}
    for role, n in trained.items():
        copies = (2 if getattr(cfg, role).optim.name == "adamw" else 0) + accumulates[role]
        persistent.append(Term(f"optimizer_state/{role}", n * a * copies, f"t={n:,} x a={a} x {copies}"))
    behind, in_flight = cfg.trainer.off_policy_steps, ()
    if behind:  # the queue of the weights older batches are sampled with, and the copy the update will push onto it
        copy = trained["actor"] * p
        persistent.append(Term("off_policy_queue", behind * copy, f"k={behind} x t={trained['actor']:,} x p={p}"))
        in_flight = (Term("weights_before_update", copy, f"t={trained['actor']:,} x p={p}"),)
    weights = rollout_weights_term(cfg, policy, mesh)
    caches = sampler_terms(cfg, policy, mesh, platform)
    rollout = (*caches[0], weights)
    validation = tuple(dataclasses.replace(term, name=f"{term.name}/validation") for term in (*caches[-1], weights)
                       if len(caches) > 1)
    updates = {title: terms for role, n in trained.items() for title, terms in update_phases(
        policy, role, role, n, micro_batch_shape(cfg, role), cfg.actor.log_prob_chunk_size, accumulates[role], mesh,
        platform).items()}
    concurrent = behind > 0 and math.prod(mesh_shape) == 1  # jppo.run.offpolicy.can_overlap, for jppo's own sampler
    return MemoryPlan(mesh, tuple(persistent), rollout, updates, validation, in_flight, concurrent)


def update_phases(policy: ModelConfig, role: str, title: str, n: int, cut: tuple[int, int], chunk: int,
                  accumulates: bool, mesh: dict[str, int], platform: str) -> dict[str, tuple[Term, ...]]:
    """The phases of one role's update (``title backward``, ``title head`` for a language model's,
    ``title optimizer step``; terms named ``.../role``) for ``n`` trained elements per device and micro-batches
    of ``cut = (r, w)``: the update lines of the module docstring."""
    (r, w), p, a = cut, dtype_bytes(policy.param_dtype), ACCUMULATOR_BYTES
    split = f"r={r} x w={w}{f' / q={row_split(w, mesh)}' if row_split(w, mesh) > 1 else ''}"
    gradients = Term(f"gradients/{role}", n * p, f"t x p={p}")
    lm = role != "critic"
    in_use = (Term(f"weights_in_use/{role}", layer_weights_bytes(policy, mesh), "layer/tensor x c") if lm else
              Term(f"weights_in_use/{role}", weights_in_use_bytes(policy, mesh), "(V'D + layer/tensor) x c"))
    # a layer's weight gradient, before it joins the stacked gradient (XLA:TPU's buffer assignment at d 256 with
    # experts, whose layers' weights outweigh their activations)
    layer_gradient = Term(f"layer_gradient/{role}", layer_weights_bytes(policy, mesh) * p // dtype_bytes(policy.dtype),
                          "layer/tensor x p")
    layout = expert_layout_bytes(policy, mesh, policy.param_dtype) if platform == "gpu" else 0
    layouts = (Term(f"expert_layout/{role}", layout, "experts' stacks x p"),) if layout else ()
    phases = {f"{title} backward": (gradients, in_use, layer_gradient, *layouts, Term(
        f"activations/{role}", activation_bytes(policy, r, w, mesh, platform),
        f"{split} x (L s + x){' + b' if linear_attention(policy, w, platform) else ''}"
        f"{' remat' if policy.remat else ''}"))}
    if lm:  # the LM head's backward pass, a chunk's logits at a time, before the layers'
        k = min(chunk, w // row_split(w, mesh))
        phases[f"{title} head"] = (
            gradients, Term(f"kept_activations/{role}", kept_activation_bytes(policy, r, w, mesh, platform),
                            f"{split} x L s"),
            Term(f"head_weights/{role}", table_bytes(policy, mesh), "V'D x c"),
            Term(f"logits/{role}", logits_bytes(policy, r, w, chunk, mesh), f"3 r k={k} V' a"))
        copies = head_copies_bytes(policy, mesh, platform)
        if copies:
            phases[f"{title} head"] += (Term(f"head_copies/{role}", copies,
                                             f"V'D x (a + {HEAD_TABLE_COPIES[platform]} c)"),)
    copies = GPU_STEP_COPIES[accumulates] if platform == "gpu" else STEP_COPIES
    phases[f"{title} optimizer step"] = (Term(f"optimizer_step/{role}", int(n * a * copies), f"t x a x {copies}"),)
    return phases


def program_bytes(cfg: TrainConfig, mesh_shape: Sequence[int], platform: str = "gpu") -> dict[str, int]:
    """The plan's peak per device of each program the run compiles, keyed as ``python -m jppo.plan --compile-for``
    names them: the arrays the program reads (a role's parameters and optimizer state, the sampler's weights) and
    what it keeps live while it runs. ``actor_update`` / ``critic_update``: parameters + optimizer state + the
    larger of the backward pass and the optimizer step; ``old_log_prob`` / ``ref_log_prob`` / ``values``: the
    weights read, the weights in use and one layer's activations of a forward micro-batch (plus the actor's logits
    chunk, without its gradient); ``rollout`` / ``validation``: the policy's parameters, the sampler's weights and
    the caches of the training / validation batch."""
    from jppo.config.views import forward_micro_batching, old_log_prob_source, reference_param_dtype  # noqa: PLC0415

    plan = memory_plan(cfg, mesh_shape, platform)
    mesh, policy = plan.mesh, model_config(cfg)
    phase = lambda title: sum(t.bytes for t in plan.updates.get(title, ()))  # noqa: E731
    out = {}
    for role in cfg.roles:
        state = plan.term(f"parameters/{role}") + plan.term(f"optimizer_state/{role}")
        out[f"{role}_update"] = state + max(phase(f"{role} {name}") for name in ("backward", "head", "optimizer step"))
    if cfg.rollout.engine == "jppo":
        for name, phase in (("rollout", plan.rollout), ("validation", plan.validation)):
            if phase:
                out[name] = plan.term("parameters/actor") + sum(term.bytes for term in phase)
    forwards = {"values": ("critic", "parameters/critic")} if "critic" in cfg.roles else {}
    if old_log_prob_source(cfg) == "recompute":
        forwards["old_log_prob"] = ("actor", "parameters/actor")
    if cfg.use_reference:  # with LoRA and no reference model: the actor's frozen base
        forwards["ref_log_prob"] = ("actor", "parameters/reference" if plan.term("parameters/reference")
                                    else "parameters/actor")
    stored_in = {"parameters/actor": policy.param_dtype, "parameters/critic": policy.param_dtype,
                 "parameters/reference": reference_param_dtype(cfg)}
    for name, (role, params) in forwards.items():
        stored, p, c = plan.term(params), dtype_bytes(stored_in[params]), dtype_bytes(policy.dtype)
        cast = (layout_copy_bytes(policy, mesh, stored_in[params]) if platform == "gpu"  # not a cast: a layout's
                else stored * c // p if p > c else 0)  # the weights in the compute dtype, one copy for the pass
        out[name] = stored + cast + forward_bytes(cfg, policy, role, forward_micro_batching(cfg, role), mesh,
                                                    platform, widened=p > c)
    return out


def forward_bytes(cfg: TrainConfig, policy: ModelConfig, role: str, cut: dict, mesh: dict[str, int],
                  platform: str = "gpu", widened: bool = False) -> int:
    """What a forward pass keeps live besides the weights it reads: one layer's weights in use and its working set
    over a micro-batch (nothing is kept for a backward pass) and, for log-probs, a chunk's float32 logits. On a TPU
    a dense layer's weights are a buffer of their own only when ``mesh.fsdp`` gathers them: otherwise the layer scan
    reads its slice of the stacked weights (or of their cast copy) in place; a layer's experts are sliced into a
    buffer of their own for the grouped products (XLA:TPU's buffer assignment, quickstart_moe at d 256 on data 8).

    On a TPU with ``mesh.fsdp`` > 1 and weights stored wider than they compute (``widened``), log-probs' layers and
    LM head are phases apart, the head's holding the logits and an untied head gathered whole, and the embedding
    table, cast and gathered whole for the lookup, lives through both (Qwen3-30B-A3B's old log-probs on
    v5p:4x4x4: ``bf16[151936, 2048]`` twice beside a chunk's logits at the pass's peak; 4.36 GiB compiled, planned
    4.37, 3.86 without; Qwen2.5-0.5B's, tied, 0.80 and 0.76, 0.65 without). A reference stored in the compute dtype
    looks its tokens up in the sharded table."""
    r, w = (1, cut["max_token_len"]) if "max_token_len" in cut else (
        cut["micro_batch_size"], prompt_width(cfg) + cfg.rollout.max_response_length)
    local = w // row_split(w, mesh)
    in_place = platform == "tpu" and mesh["fsdp"] == 1 and not policy.sparse_layers
    in_use = 0 if in_place else layer_weights_bytes(policy, mesh)
    layers = in_use + r * local * forward_layer_bytes_per_token(policy, w, mesh, platform, r * local)
    if role != "actor":
        return layers
    logits = logits_bytes(policy, r, w, cfg.actor.log_prob_chunk_size, mesh) // LOGIT_COPIES  # fused softmax
    if platform != "tpu" or mesh["fsdp"] == 1 or not widened:
        return layers + logits
    table = table_bytes(policy, mesh)
    return table + max(layers, logits + (0 if policy.tie_word_embeddings else table))


def reference_term(cfg: TrainConfig, policy: ModelConfig, mesh: dict[str, int]) -> Term:
    """The KL reference's weights: ``n_w r + n_s p``, its ``n_w`` weights in ``r`` = the bytes of
    ``ref.param_dtype`` (default ``model.dtype``) and its ``n_s`` norm scales kept in ``p``
    (:func:`jppo.run.build.kept_in`)."""
    from flax import nnx  # noqa: PLC0415

    from jppo.config.views import reference_param_dtype  # noqa: PLC0415
    from jppo.models.layers import is_norm_scale  # noqa: PLC0415

    reference = model_config(cfg, cfg.ref.model_path) if cfg.ref.model_path else policy
    params = abstract_params(reference)
    scales = nnx.filter_state(params, lambda path, _: is_norm_scale(str(path[-1])))
    n, n_s = local_elements(params, mesh), local_elements(scales, mesh)
    r, p = dtype_bytes(reference_param_dtype(cfg)), dtype_bytes(reference.param_dtype)
    return Term("parameters/reference", (n - n_s) * r + n_s * p, f"n_w={n - n_s:,} x r={r} + n_s={n_s:,} x p={p}")


def accumulates_gradients(cfg: TrainConfig, role: str, mesh: dict[str, int]) -> bool:
    """Whether ``role`` keeps a gradient accumulator: unless every optimizer step is one micro-batch
    (:func:`jppo.engine.config.fixed_micro_batch_count`)."""
    from jppo.config.views import engine_view  # noqa: PLC0415 (views imports the models; keep `--help` light)
    from jppo.engine.config import fixed_micro_batch_count  # noqa: PLC0415

    return (
        fixed_micro_batch_count(engine_view(cfg, role), row_shards_of([mesh.get(axis, 1) for axis in MESH_AXES])) != 1
    )
