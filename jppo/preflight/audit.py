"""The contract audit (``python -m jppo.audit``): does this configuration keep the contract?

Builds the configured model(s) and the rollout batch of one training step (the configured prompts, ragged random
responses, an empty response among them, random advantages, log-probs, values and returns; sampler log-probs that
differ from the old ones, so ``actor.rollout_correction`` weighs or rejects rows, its rejection applied as
collection applies it, before the cut), then runs that whole step's updates (every mini-batch of every epoch)
through the trainer's own path, ``run_updates`` and the compiled ``UpdateStep``, under many cuts: fixed
micro-batches of several sizes, token-budget packing, and every mesh shape the local devices allow. Each cut is
compared with the reference (one device, one micro-batch per mini-batch): the accumulated gradient of every
optimizer step, as the optimizer itself recorded it, as ``||g - g_ref|| / ||g_ref||`` (the first step's alone, and
all steps'), and every reported metric (losses, clip fractions, KL, entropy, value means, gradient norms, learning
rate, skipped updates, ``rollout_corr/*``), as the largest relative difference. The last lines read
``max_rel_first_step_grad_diff=<v>``, ``max_rel_grad_diff=<v>`` and ``max_rel_metric_diff=<v>``.

Rounding is not a cut: after the first optimizer step the parameters differ by float32 rounding, and an optimizer
amplifies it: Adam's update is about ``lr * g / (|g| + eps)`` per entry, so an entry whose gradient is small
carries its rounding into the step at the scale of ``lr`` (the quickstart's critic, with its clipped value loss:
3e-7 at the first step, 1e-4 after it; 2e-6 without the value clip, no growth with SGD or with Adam's ``eps`` at
1e-4). A real dependence on the cut does not shrink with the precision, rounding does: a row whose
first step is within the configured dtype's tolerance (1e-5 in float32) but whose later steps or metrics are not is
run again, with its reference, in float64 (the same parameters and batch, ``jax_enable_x64``), where rounding is
~1e-15 and the row must be within :data:`FLOAT64_TOLERANCE`. ``float64=True`` (``--float64``) runs every row so.
The exit status is 0 when every row is within tolerance (see :func:`row_verdict`), 1 otherwise, 2 for a bad
setting (one line on stderr, found before or while the audit runs). With ``trainer.deterministic: bitwise`` every row
must be exact (0 on every column), on the cuts and meshes the mode runs on: fixed micro-batches, ``data`` x ``fsdp``
meshes of a power-of-two size.
A legacy ``normalization=per_micro_batch`` config shows its split-dependence here instead of hiding it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys

import jax
import numpy as np
from flax import nnx

from jppo.config import TrainConfig
from jppo.config.views import engine_view, optimizer_steps_per_training_step, rollout_sequences
from jppo.core.experience import Experience
from jppo.engine import (
    UpdateStep,
    actor_loss_fn,
    check_batch_sizes,
    critic_loss_fn,
    init_train_state,
    run_updates,
    sft_loss_fn,
    step_micro_batches,
)
from jppo.models import param_shardings
from jppo.parallel.mesh import batch_shards, make_mesh
from jppo.preflight.audit_cuts import ONE_DEVICE, audit_batch, cuts, parse_meshes, role_meshes
from jppo.run import build
from jppo.run.filters import rejected_rows_cleared
from jppo.run.learn import mini_batch_rng

TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 5e-3, "float64": 1e-9}
# float64's rounding is ~1e-15 even after an optimizer amplified it a thousandfold; a dependence on the cut is
# orders above (a metric formed per micro-batch, a K-fold normalization: 1e-3 to 1)
FLOAT64_TOLERANCE = TOLERANCE["float64"]


def tolerance_of(cfg: TrainConfig, float64: bool = False) -> float:
    """A row's tolerance in the precision it runs in: float64's, or the configured ``model.dtype``'s."""
    return FLOAT64_TOLERANCE if float64 else TOLERANCE.get(cfg.model.dtype, TOLERANCE["float32"])


def flat(tree) -> np.ndarray:
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])


@dataclasses.dataclass
class Outcome:
    """One whole training step's updates under one cut."""

    gradients: list[np.ndarray]  # the accumulated gradient of each optimizer step, flattened
    metrics: dict[str, float]
    micro_batches: int  # K of the step that cut into the most


class Role:
    """One model under audit: its parameters, and the trainer's update path for it on any mesh and cut."""

    def __init__(
        self, name: str, graphdef: nnx.GraphDef, params: nnx.State, loss_of, update_cfg, seed: int,
        frozen: nnx.State | None = None,
    ):
        # kept on the host: every cut places its own copy (the update donates its state); ``frozen``: LoRA's base
        self.name, self.graphdef, self.params = name, graphdef, jax.device_get(params)
        self.frozen = None if frozen is None else jax.device_get(frozen)
        self.loss_of, self.cfg = loss_of, update_cfg
        self.seed = seed

    def run(self, mesh, batch: Experience, cut: dict) -> Outcome:
        """All mini-batches and epochs of step 1, exactly as the trainer runs them (same shuffling seed)."""
        cfg = dataclasses.replace(self.cfg, **cut)
        check_batch_sizes(cfg, batch.num_sequences, batch_shards(mesh), self.name)
        params = jax.device_put(self.params, param_shardings(self.params, mesh))
        frozen = None if self.frozen is None else jax.device_put(self.frozen, param_shardings(self.frozen, mesh))
        state = init_train_state(params, cfg, mesh, keep_gradient=True, frozen=frozen)
        step = UpdateStep(self.graphdef, self.loss_of(cfg), cfg, mesh, self.name, keep_gradient=True)
        rng = lambda: mini_batch_rng(self.seed, 1, self.name)  # noqa: E731 (the trainer's draw for step 1)
        k = max(m.num_micro_batches for m in step_micro_batches(batch, cfg, mesh, rng()))
        updated = run_updates(step, state, batch, cfg, mesh, rng())
        gradients = jax.device_get(updated.gradients)
        per_step = [flat(jax.tree.map(lambda g: g[i], gradients)) for i in range(len(jax.tree.leaves(gradients)[0]))]
        return Outcome(per_step, updated.metrics, k)


def build_roles(cfg: TrainConfig, inputs: build.RunInputs) -> list[Role]:
    """The models under audit, built as the trainer builds them (:func:`jppo.run.build.models`), on one device."""
    cpu = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    models = build.models(cfg, inputs.tokenizer, cpu, reference=False)
    seed, actor = cfg.trainer.seed, models.actor
    actor_loss = lambda update_cfg: actor_loss_fn(update_cfg, cfg.rollout.temperature)  # noqa: E731
    roles = [Role("actor", actor.graphdef, actor.params, actor_loss, engine_view(cfg, "actor"), seed, actor.frozen)]
    if models.critic is not None:
        critic = models.critic
        roles.append(Role("critic", critic.graphdef, critic.params, critic_loss_fn, engine_view(cfg, "critic"), seed,
                          critic.frozen))
    return roles


def in_float64(tree):
    """Every floating array of ``tree`` (parameters, a batch) as float64 (host arrays; ``None`` stays)."""
    def cast(x):
        x = np.asarray(x)
        return x.astype(np.float64) if np.issubdtype(x.dtype, np.floating) else x
    return None if tree is None else jax.tree.map(cast, tree)


def float64_roles(cfg: TrainConfig, build_fn, roles: list[Role]) -> list[Role]:
    """``roles`` in float64: the models ``build_fn(cfg)`` builds with ``model.dtype`` and ``param_dtype`` float64
    (needs ``jax_enable_x64``), holding the float32 roles' parameters cast, so a float64 row runs the same step."""
    model = dataclasses.replace(cfg.model, dtype="float64", param_dtype="float64")
    built = build_fn(dataclasses.replace(cfg, model=model))
    return [Role(role.name, wide.graphdef, in_float64(role.params), role.loss_of, role.cfg, role.seed,
                 in_float64(role.frozen)) for role, wide in zip(roles, built)]


def relative(name: str, a: float, b: float) -> float:
    """``|a - b|`` relative to ``|b|``, and to the scale of the quantities the metric is computed from when it is
    smaller than that: 1e-3 for a clip fraction or KL near 0, 1 for an explained variance (``1 - Var(d) / Var(t)``
    near 0 is a difference of two numbers near 1, exact only to their float32 rounding)."""
    floor = 1.0 if name.endswith("_explained_var") else 1e-3
    return abs(a - b) / max(abs(b), floor)


def gradient_diffs(outcome: Outcome, reference: Outcome) -> tuple[float, float]:
    """Relative difference ``||g - g_ref|| / ||g_ref||`` of the first optimizer step's gradient, and of all steps'
    gradients concatenated."""
    first = np.linalg.norm(outcome.gradients[0] - reference.gradients[0]) / max(
        np.linalg.norm(reference.gradients[0]), 1e-30
    )
    whole, whole_ref = np.concatenate(outcome.gradients), np.concatenate(reference.gradients)
    return float(first), float(np.linalg.norm(whole - whole_ref) / max(np.linalg.norm(whole_ref), 1e-30))


def row_verdict(first: float, later: float, tolerance: float) -> str:
    """``within``, ``outside``, or ``float64`` (decide in float64) for a row whose first optimizer step's gradient
    differs by ``first`` and whose later steps and metrics by ``later`` (their largest). The first step has the
    same parameters under every cut: nothing amplifies its rounding, so a difference beyond ``tolerance`` is the
    cut's. Later steps beyond it are rounding amplified by the optimizer or a real dependence: float64 tells."""
    if first > tolerance:
        return "outside"
    return "within" if later <= tolerance else "float64"


@dataclasses.dataclass
class Worst:
    first_step: float = 0.0  # gradient of the first optimizer step: same parameters, only the cut differs
    gradient: float = 0.0  # gradients of all optimizer steps
    metric: float = 0.0
    rechecked: int = 0  # rows decided in float64
    float64: float = 0.0  # their largest difference there (any column)
    outside: int = 0  # rows outside tolerance

    def passes(self) -> bool:
        return self.outside == 0


def in_precision(float64: bool):
    """``jax_enable_x64`` on for a float64 run; otherwise the process's setting as it is."""
    return jax.enable_x64(True) if float64 else contextlib.nullcontext()


def compare(outcome: Outcome, reference: Outcome) -> tuple[float, float, float, str]:
    """A cut against the reference: the first step's and all steps' gradient differences, the largest metric
    difference and its name (a metric one of them lacks differs infinitely)."""
    first, diff = gradient_diffs(outcome, reference)
    metric_diffs = {name: relative(name, outcome.metrics[name], value)
                    for name, value in reference.metrics.items() if name in outcome.metrics}
    metric_diffs.update({name: float("inf") for name in set(reference.metrics) ^ set(outcome.metrics)})
    name, metric_diff = max(metric_diffs.items(), key=lambda item: item[1])
    return first, diff, metric_diff, name if metric_diff > 0 else "-"


def audit(
    cfg: TrainConfig, inputs: build.RunInputs, quick: bool = False, out=None, meshes: str | None = None,
    float64: bool = False,
) -> Worst:
    """Prints the table; returns the largest relative differences. Every cut runs on one device; each mesh of all
    devices runs the finest cuts (``quick``: only the pure data-parallel mesh, a 3-D one and a context-parallel
    one, the last with the tight token budget alone). ``meshes`` (``--meshes``): these shapes instead, in this
    order (:func:`parse_meshes`); a one-device shape runs every cut. A row that :func:`row_verdict` sends to float64
    is followed by its float64 line; ``float64``: every row in float64."""
    out = sys.stdout if out is None else out
    rows = rollout_sequences(cfg)
    # verl's rejection modes clear rows' masks at collection, before the batch is cut: the audit does the same
    batch, rejection = rejected_rows_cleared(audit_batch(cfg, inputs, rows), cfg.actor.rollout_correction)
    chosen_meshes = None
    if meshes is not None:  # checked against every role's mini-batch before anything is built or compiled
        for role in cfg.roles:
            chosen_meshes = parse_meshes(meshes, jax.device_count(), engine_view(cfg, role).ppo_mini_batch_size)
    steps = {role: optimizer_steps_per_training_step(cfg, role) for role in cfg.roles}
    print(f"jppo.audit: one training step of {rows} sequences ({steps['actor']} actor optimizer steps"
          + (f", {steps['critic']} critic" if cfg.use_critic else "") + f"), {int(batch.response_mask.sum())} loss "
          f"tokens, {jax.device_count()} devices, {'float64' if float64 else cfg.model.dtype}, normalization "
          f"actor={cfg.actor.normalization} critic={cfg.critic.normalization}, "
          f"rollout correction {cfg.actor.rollout_correction.mode}"
          + "".join(f" ({name} {value:.3g})" for name, value in rejection.items()), file=out)
    build_fn = functools.partial(build_roles, inputs=inputs)
    return compare_cuts(cfg, build_fn, batch, quick, out, chosen_meshes, float64)


def audit_sft(cfg: TrainConfig, inputs, quick: bool = False, out=None, meshes: str | None = None,
              float64: bool = False) -> Worst:
    """:func:`audit` of ``python -m jppo.sft``'s update (``jppo.audit --sft``): its first step's
    ``sft.batch_size`` rows (``inputs``: :func:`jppo.run.sft.load_inputs`) under the same cuts and meshes."""
    from jppo.run import sft  # noqa: PLC0415 (the SFT loop, loaded for this audit only)

    out = sys.stdout if out is None else out
    view = sft.sft_view(cfg)
    chosen_meshes = None if meshes is None else parse_meshes(meshes, jax.device_count(), view.ppo_mini_batch_size)
    batch = inputs.train.experience(inputs.train.rows_at(0, cfg.sft.batch_size, cfg.trainer.seed))
    print(f"jppo.audit: one SFT step of {batch.num_sequences} rows, {int(batch.response_mask.sum())} loss tokens, "
          f"{jax.device_count()} devices, loss_agg_mode {view.loss_agg_mode}, normalization {view.normalization}",
          file=out)

    def sft_role(config: TrainConfig) -> list[Role]:
        cpu = make_mesh(1, 1, 1, devices=jax.devices()[:1])
        actor = build.models(config, inputs.tokenizer, cpu, roles=("actor",), reference=False).actor
        return [Role("sft", actor.graphdef, actor.params, sft_loss_fn, view, config.trainer.seed, actor.frozen)]

    return compare_cuts(cfg, sft_role, batch, quick, out, chosen_meshes, float64)


def compare_cuts(cfg: TrainConfig, build_fn, batch: Experience, quick: bool, out, chosen_meshes,
                 float64: bool) -> Worst:
    """Each role ``build_fn(cfg)`` builds, its step under every cut and mesh against its one-device,
    one-micro-batch reference, a table row each (and a float64 row under each that :func:`row_verdict` sends
    there; ``float64``: every row in float64); the largest relative differences."""
    roles, tolerance = build_fn(cfg), tolerance_of(cfg, float64)
    widen = functools.partial(float64_roles, cfg, build_fn)
    devices, longest = jax.device_count(), int(batch.lengths().max())
    reference_mesh = make_mesh(*ONE_DEVICE, devices=jax.devices()[:1])
    worst = Worst()
    header = (f"{'model':<7} {'mesh (d,f,t,s)':<14} {'cut':<16} {'K':>3} {'grad step 1':>12} {'grad all steps':>14} "
              f"{'metrics':>10}  {'worst metric':<22}")
    print(header, file=out)
    print("-" * len(header), file=out)
    wide_batch, wide_roles = in_float64(batch), None
    if float64:
        with jax.enable_x64(True):
            roles = widen(roles)
        batch = wide_batch
    for index, role in enumerate(roles):
        mini, bitwise = role.cfg.ppo_mini_batch_size, role.cfg.bitwise
        whole = {"use_dynamic_bsz": False, "ppo_micro_batch_size": mini}
        with in_precision(float64):
            reference = role.run(reference_mesh, batch, whole)
        wide_reference = None
        print(f"compared ({role.name}): {', '.join(sorted(reference.metrics))}", file=out)
        for shape in chosen_meshes or role_meshes(devices, mini, quick, bitwise):
            mesh = make_mesh(*shape, devices=jax.devices()[: int(np.prod(shape))])
            chosen = cuts(mini, batch_shards(mesh), longest, every=shape == ONE_DEVICE, sequence=shape[3],
                          bitwise=bitwise)
            # quick: the context-parallel mesh runs the tight budget alone (packed rows, each split over the axis)
            for label, cut in chosen[1:] if quick and shape[3] > 1 else chosen:
                if shape == ONE_DEVICE and cut == whole:  # the reference's own cut: its program, on its batch
                    outcome = reference
                else:
                    with in_precision(float64):
                        outcome = role.run(mesh, batch, cut)
                first, diff, metric_diff, name = compare(outcome, reference)
                worst.first_step, worst.gradient = max(worst.first_step, first), max(worst.gradient, diff)
                worst.metric = max(worst.metric, metric_diff)
                print(f"{role.name:<7} {str(shape):<14} {label:<16} {outcome.micro_batches:>3} {first:>12.3e} "
                      f"{diff:>14.3e} {metric_diff:>10.3e}  {name}", file=out)
                verdict = row_verdict(first, max(diff, metric_diff), 0.0 if bitwise else tolerance)
                if bitwise:  # trainer.deterministic: bitwise: every row exact, nothing to decide in float64
                    verdict = "within" if max(first, diff, metric_diff) == 0 else "outside"
                if verdict == "float64" and not float64:  # rounding amplified, or the cut's: float64 tells
                    with jax.enable_x64(True):
                        if wide_reference is None:
                            wide_roles = wide_roles or widen(roles)
                            wide_reference = wide_roles[index].run(reference_mesh, wide_batch, whole)
                        wide = compare(wide_roles[index].run(mesh, wide_batch, cut), wide_reference)
                    worst.rechecked += 1
                    worst.float64 = max(worst.float64, *wide[:3])
                    verdict = "within" if max(wide[:3]) <= FLOAT64_TOLERANCE else "outside"
                    print(f"{'':<7} {'':<14} {'  in float64':<16} {'':>3} {wide[0]:>12.3e} {wide[1]:>14.3e} "
                          f"{wide[2]:>10.3e}  {wide[3]}", file=out)
                worst.outside += verdict != "within"
    return worst
