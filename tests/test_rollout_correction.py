"""Rollout/trainer mismatch correction (``actor.rollout_correction``): every mode against a numpy reference, ``none``
bit for bit the uncorrected loss, verl's rejection removing rows from every term, split invariance of every mode,
the engine carrying it, and config errors.

The numpy reference is written from the definitions alone (``jppo/losses/rollout_correction.py``'s docstring, verl's
``rollout_corr_helper.py``): ``d = logp_old - logp_roll``; ``token_tis`` weighs token t by ``min(exp(d_t), tau)``,
``seq_tis`` every token of a row by ``min(p, tau)`` with ``p`` the product of the row's ratios, ``geo_tis`` by
``min(g, tau)`` with ``g`` their geometric mean; ``seq_rs`` / ``geo_rs`` clear the mask of rows with ``p`` / ``g``
outside ``[1/tau, tau]`` (they leave every term and the denominators), ``geo_mask`` zeroes the policy term of rows
with ``g`` outside it (they stay in the denominators). Aggregation is written as one coefficient per token
(``share = sum_t c_t m_t l_t``), so a loss linear in ``logp`` also gives the reference gradient.
"""

from __future__ import annotations

import dataclasses
import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_cases import ragged_batch
from test_engine_update import CUTS, actor_cfg, engine_step, mesh_of, per_shard, reference
from test_losses_invariance import make_batch, padding_row, random_splits

from jppo.config import ConfigError, load_config
from jppo.config.views import engine_view
from jppo.core import metrics as metrics_lib
from jppo.core.experience import Experience
from jppo.core.masked import global_norm_stats
from jppo.engine import ActorConfig
from jppo.engine.objectives import loss_inputs
from jppo.losses import (
    AGG_MODES,
    REJECTION_MODES,
    ROLLOUT_CORRECTION_MODES,
    PolicyLossOptions,
    RolloutCorrection,
    actor_loss,
    rollout_weights,
)
from jppo.models.decoder import CausalLM
from jppo.run.filters import rejected_rows_cleared

ROOT = pathlib.Path(__file__).resolve().parents[1]
C = 7.0
CORRECTIONS = {
    "none": RolloutCorrection("none"),
    "token_tis": RolloutCorrection("token_tis", 1.2),
    "seq_tis": RolloutCorrection("seq_tis", 1.1),
    "geo_tis": RolloutCorrection("geo_tis", 1.1),
    "seq_rs": RolloutCorrection("seq_rs", 1.5),
    "geo_rs": RolloutCorrection("geo_rs", 1.15),
    "geo_mask": RolloutCorrection("geo_mask", 1.15),
}
OPTIONS = PolicyLossOptions(clip_ratio_high=0.28, clip_ratio_c=2.0)


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def ragged(seed: int, rows: int = 7, length: int = 6) -> dict[str, np.ndarray]:
    """Uneven response lengths, an empty row, a one-token row; per-row offsets between the sampler's and the
    trainer's log-probs wide enough that seq_mask rejects some rows and keeps others; NaN under the mask."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, length + 1, rows)
    lengths[0], lengths[1] = 0, 1
    mask = np.arange(length) < lengths[:, None]
    old = -rng.exponential(1.0, (rows, length))
    rollout = old - rng.normal(0, 0.15, (rows, 1)) - rng.normal(0, 0.2, (rows, length))
    batch = {
        "mask": mask.astype(np.float64),
        "log_prob": old + rng.normal(0, 0.3, (rows, length)),
        "old_log_prob": old,
        "rollout_log_prob": rollout,
        "advantages": rng.normal(size=(rows, length)),
    }
    return {k: v if k == "mask" else np.where(mask, v, np.nan) for k, v in batch.items()}


def np_coefficients(mask: np.ndarray, mode: str) -> np.ndarray:
    """Per-token factor of each aggregation mode over the whole batch: N, S and C by their definitions."""
    n_row = mask.sum(1, keepdims=True)
    n, s = mask.sum(), (n_row > 0).sum()
    per_token = {
        "token-mean": np.full_like(mask, 1 / n),
        "token-sum": np.ones_like(mask),
        "seq-mean-token-sum": np.full_like(mask, 1 / s),
        "seq-mean-token-mean": 1 / (np.maximum(n_row, 1) * s) * np.ones_like(mask),
        "seq-mean-token-sum-norm": np.full_like(mask, 1 / (s * C)),
    }[mode]
    return per_token * mask


def np_row_ratios(b: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """``[N, 1]`` each: the product of a row's token ratios ``exp(d_t)`` and their geometric mean (1 for an empty
    row), multiplied out token by token in float64."""
    mask = b["mask"].astype(bool)
    ratios = np.where(mask, np.exp(np.where(mask, b["old_log_prob"] - b["rollout_log_prob"], 0.0)), 1.0)
    product = np.prod(ratios, axis=1, keepdims=True)
    n_row = mask.sum(1, keepdims=True)
    return product, product ** (1 / np.maximum(n_row, 1))


def np_rejected(b: dict[str, np.ndarray], correction: RolloutCorrection) -> np.ndarray:
    """``[N]``: the rows verl's rejection removes (``seq_rs``: product, ``geo_rs``: geometric mean outside
    ``[1/tau, tau]``); none in the other modes."""
    product, geo = np_row_ratios(b)
    ratio = {"seq_rs": product, "geo_rs": geo}.get(correction.mode)
    if ratio is None:
        return np.zeros(len(product), bool)
    tau = correction.threshold
    return ((ratio < 1 / tau) | (ratio > tau))[:, 0]


def np_weights(b: dict[str, np.ndarray], correction: RolloutCorrection) -> np.ndarray:
    mask = b["mask"].astype(bool)
    d = np.where(mask, b["old_log_prob"] - b["rollout_log_prob"], 0.0)
    product, geo = np_row_ratios(b)
    tau = correction.threshold
    if correction.mode == "token_tis":
        return np.minimum(np.exp(d), tau)
    if correction.mode == "seq_tis":
        return np.broadcast_to(np.minimum(product, tau), d.shape)
    if correction.mode == "geo_tis":
        return np.broadcast_to(np.minimum(geo, tau), d.shape)
    if correction.mode == "geo_mask":
        return np.broadcast_to(((geo >= 1 / tau) & (geo <= tau)).astype(float), d.shape)
    return np.ones_like(d)  # none, and the rejection modes: their rows are out of the mask, no weight


def collected(b: dict[str, np.ndarray], correction: RolloutCorrection) -> dict[str, np.ndarray]:
    """The batch as collection hands it to the update: ``seq_rs`` / ``geo_rs`` rows' masks cleared by the
    trainer's own :func:`rejected_rows_cleared` (checked against :func:`np_rejected` in the rejection test)."""
    exp = Experience(response_mask=b["mask"], old_log_prob=b["old_log_prob"], rollout_log_prob=b["rollout_log_prob"])
    return b | {"mask": np.asarray(rejected_rows_cleared(exp, correction)[0].response_mask)}


def np_metrics(b: dict[str, np.ndarray], correction: RolloutCorrection) -> dict[str, float]:
    mask = b["mask"].astype(bool)
    d = (b["old_log_prob"] - b["rollout_log_prob"])[mask]
    rows = mask.any(1)
    rejected = (np_weights(b, correction)[:, 0] == 0) & rows if correction.mode == "geo_mask" else np.zeros_like(rows)
    return {
        "rollout_corr/kl": float(np.mean(-d)),
        "rollout_corr/ratio_mean": float(np.mean(np.exp(d))),
        "rollout_corr/masked_fraction": rejected.sum() / rows.sum(),
    }


def np_vanilla(b: dict[str, np.ndarray]) -> np.ndarray:
    """PPO's per-token loss with asymmetric and dual clip (OPTIONS), 0 under the mask."""
    a = np.nan_to_num(b["advantages"])
    r = np.exp(np.nan_to_num(b["log_prob"] - b["old_log_prob"]))
    loss = np.maximum(-a * r, -a * np.clip(r, 1 - OPTIONS.low, 1 + OPTIONS.high))
    return np.where(a < 0, np.minimum(loss, -a * OPTIONS.clip_ratio_c), loss)


def shares(batch, correction, policy_loss_name="vanilla"):
    """``{mode: ((share, metrics), d share / d log_prob)}`` for every aggregation mode."""

    @jax.jit
    def run(x):
        norm = global_norm_stats(x["mask"], C)
        out = {}
        for mode in AGG_MODES:
            def share(log_prob, mode=mode):
                return actor_loss(
                    log_prob, x["old_log_prob"], x["advantages"], x["mask"], norm=norm, mode=mode,
                    policy_loss_name=policy_loss_name, policy_options=OPTIONS, rollout_correction=correction,
                    rollout_log_prob=x.get("rollout_log_prob"),
                )

            out[mode] = jax.value_and_grad(share, has_aux=True)(x["log_prob"])
        return out

    return run({k: jnp.asarray(v) for k, v in batch.items()})


def test_the_test_batches_exercise_every_mode():
    assert set(CORRECTIONS) == set(ROLLOUT_CORRECTION_MODES)
    for b in [ragged(seed) for seed in range(3)] + [_invariance_batch(seed) for seed in range(2)]:
        rows = b["mask"].sum(1)
        assert (rows == 0).sum() == 1 and len(set(rows)) > 2
        assert 0 < np_metrics(b, CORRECTIONS["geo_mask"])["rollout_corr/masked_fraction"] < 1
        for name in ("token_tis", "seq_tis", "geo_tis"):
            w = np_weights(b, CORRECTIONS[name])[b["mask"] > 0]
            assert (w == CORRECTIONS[name].threshold).any() and (w < CORRECTIONS[name].threshold).any(), name
        for name in REJECTION_MODES:
            assert 0 < np_rejected(b, CORRECTIONS[name]).sum() < (rows > 0).sum(), name


def test_seq_tis_is_the_clipped_product_of_token_ratios_geo_tis_their_geometric_mean():
    """verl's ``rollout_is: sequence`` weight ``min(prod_t r_t, tau)`` (its rollout_corr_helper.py), and the
    length-normalized variant, against ratios multiplied out in float64 on a ragged batch."""
    b = ragged(0)
    mask = b["mask"] > 0
    product, geo = np_row_ratios(b)
    assert not np.allclose(np.minimum(product, 1.1)[mask.any(1)], np.minimum(geo, 1.1)[mask.any(1)])
    for name, ratio in (("seq_tis", product), ("geo_tis", geo)):
        correction = CORRECTIONS[name]
        weights, _ = rollout_weights(jnp.asarray(b["old_log_prob"]), jnp.asarray(b["rollout_log_prob"]),
                                     jnp.asarray(b["mask"]), correction)
        expected = np.broadcast_to(np.minimum(ratio, correction.threshold), mask.shape)
        np.testing.assert_allclose(np.asarray(weights)[mask], expected[mask], rtol=1e-12, err_msg=name)


@pytest.mark.parametrize("name", sorted(CORRECTIONS))
@pytest.mark.parametrize("seed", [0, 1])
def test_each_mode_matches_a_numpy_reference(name, seed):
    correction = CORRECTIONS[name]
    b = ragged(seed) | {}
    collected_mask = collected(b, correction)["mask"]
    b["mask"] = np.where(np_rejected(b, correction)[:, None], 0.0, b["mask"])  # the reference's own rejection
    weights = np_weights(b, correction)
    expected_metrics = np_metrics(b, correction)
    vanilla = np_vanilla(b)
    np.testing.assert_array_equal(collected_mask, b["mask"])
    for mode, ((share, metrics), _) in shares(b, correction).items():
        coefficients = np_coefficients(b["mask"], mode)
        np.testing.assert_allclose(float(share), np.sum(coefficients * weights * vanilla), rtol=1e-12, err_msg=mode)
        finished = metrics_lib.finish(metrics)
        for key, value in expected_metrics.items():
            np.testing.assert_allclose(float(finished[key]), value, rtol=1e-12, atol=1e-15, err_msg=f"{mode} {key}")
    # gpg's loss -A logp is linear in logp: its gradient is -A w c, the weight under stop-gradient
    advantages = np.nan_to_num(b["advantages"])
    for mode, ((share, _), grad) in shares(b, correction, "gpg").items():
        coefficients = np_coefficients(b["mask"], mode)
        np.testing.assert_allclose(np.asarray(grad), -advantages * weights * coefficients, rtol=1e-12, atol=1e-15,
                                   err_msg=mode)


def test_none_is_the_uncorrected_loss_bit_for_bit():
    b = ragged(0)
    uncorrected = {k: v for k, v in b.items() if k != "rollout_log_prob"}
    with_rollout = shares(b, CORRECTIONS["none"])
    without = shares(uncorrected, RolloutCorrection())
    for mode in AGG_MODES:
        (share, metrics), grad = with_rollout[mode]
        (share0, metrics0), grad0 = without[mode]
        assert np.array_equal(np.asarray(share), np.asarray(share0)), mode
        assert np.array_equal(np.asarray(grad), np.asarray(grad0)), mode
        assert set(metrics) - set(metrics0) == {"rollout_corr/kl", "rollout_corr/ratio_mean",
                                                "rollout_corr/masked_fraction"}
        for key in metrics0:
            assert np.array_equal(np.asarray(metrics[key].numerator), np.asarray(metrics0[key].numerator)), key


def _invariance_batch(seed: int) -> dict[str, np.ndarray]:
    """The invariance tests' ragged batch (garbage under the mask) with sampler log-probs whose per-row offsets
    make seq_mask reject some rows."""
    batch = make_batch(seed)
    rng = np.random.default_rng(500 + seed)
    mask = batch["mask"] > 0
    rollout = batch["old_log_prob"] - rng.normal(0, 0.15, (mask.shape[0], 1)) - rng.normal(0, 0.2, mask.shape)
    batch["rollout_log_prob"] = np.where(mask, rollout, np.nan)
    return batch


def objective(correction: RolloutCorrection):
    """``run(x, norm) -> {mode: ((share, metrics), d share / d log_prob)}`` of the whole actor objective (policy
    term with ``correction``, entropy bonus, k3+ KL loss); without ``x["rollout_log_prob"]`` the uncorrected one."""

    @jax.jit
    def run(x, norm):
        out = {}
        for mode in AGG_MODES:
            def share(log_prob, mode=mode):
                return actor_loss(
                    log_prob, x["old_log_prob"], x["advantages"], x["mask"], norm=norm, mode=mode,
                    policy_loss_name="vanilla", policy_options=OPTIONS, entropy=x["entropy"], entropy_coeff=0.01,
                    ref_log_prob=x["ref_log_prob"], kl_loss_coef=0.1, kl_loss_type="k3+",
                    rollout_log_prob=x.get("rollout_log_prob"), rollout_correction=correction,
                )

            out[mode] = jax.value_and_grad(share, has_aux=True)(x["log_prob"])
        return out

    return run


@pytest.mark.parametrize("name", REJECTION_MODES)
@pytest.mark.parametrize("seed", [0, 1])
def test_rejection_removes_the_rows_from_every_term(name, seed):
    """verl's rejection: collection clears the rejected rows' mask (the rows of :func:`np_rejected`), so N and S
    count the kept rows only, and the whole objective (policy, entropy and KL terms: shares, metrics, gradient) is
    the uncorrected one of the kept rows alone; a rejected row's gradient is exactly 0."""
    correction = CORRECTIONS[name]
    batch = _invariance_batch(seed)
    mask = batch["mask"] > 0
    exp = Experience(response_mask=batch["mask"], old_log_prob=batch["old_log_prob"],
                     rollout_log_prob=batch["rollout_log_prob"])
    cleared, metrics = rejected_rows_cleared(exp, correction)
    rejected = np_rejected(batch, correction)
    sequences = mask.any(1)
    np.testing.assert_array_equal(np.asarray(cleared.response_mask), np.where(rejected[:, None], 0.0, batch["mask"]))
    assert metrics == {"rollout_corr/rejected_fraction": pytest.approx((rejected & sequences).sum() / sequences.sum())}
    kept = np.flatnonzero(~rejected)
    norm = global_norm_stats(jnp.asarray(cleared.response_mask), C)
    assert float(norm.num_tokens) == mask[kept].sum() and float(norm.num_seqs) == sequences[kept].sum()
    corrected = objective(correction)({k: jnp.asarray(v) for k, v in batch.items()} | {"mask": cleared.response_mask},
                                      norm)
    alone = {k: jnp.asarray(v[kept]) for k, v in batch.items() if k != "rollout_log_prob"}
    uncorrected = objective(RolloutCorrection())(alone, global_norm_stats(alone["mask"], C))
    for mode in AGG_MODES:
        (share, metrics), grad = corrected[mode]
        (share0, metrics0), grad0 = uncorrected[mode]
        np.testing.assert_allclose(float(share), float(share0), rtol=1e-12, err_msg=mode)
        np.testing.assert_allclose(np.asarray(grad)[kept], np.asarray(grad0), rtol=1e-12, atol=1e-15, err_msg=mode)
        assert not np.asarray(grad)[rejected].any(), mode
        finished, finished0 = metrics_lib.finish(metrics), metrics_lib.finish(metrics0)
        for key in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/pg_clipfrac", "actor/ppo_kl"):
            np.testing.assert_allclose(float(finished[key]), float(finished0[key]), rtol=1e-12, err_msg=f"{mode} {key}")


def test_collection_clears_the_rejected_rows_of_a_bfloat16_sampler(tmp_path):
    """The trainer's own collect() with a bfloat16 sampler beside the float32 trainer (the mismatch verl's
    rejection is for): the rows whose product of ratios, from the batch's own log-probs, leaves [1/tau, tau] have
    their response mask cleared, the others keep theirs, and rollout_corr/rejected_fraction counts them."""
    from jppo.parallel.mesh import make_mesh
    from jppo.run import build
    from jppo.run.collect import collect
    from jppo.run.loop import setup
    from jppo.runlog.timing import PhaseTimer

    tau = 1.001  # the mismatch moves a row's log-ratio sum by 1e-4 to 4e-3 here: some rows go, some stay
    cfg = load_config(ROOT / "configs" / "quickstart_grpo.yaml", [
        "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=4", "rollout.dtype=bfloat16",
        "actor.rollout_correction.mode=seq_rs", f"actor.rollout_correction.threshold={tau}", "mesh.data=1",
        "trainer.val_every=0", f"trainer.output_dir={tmp_path}",
    ])
    with jax.enable_x64(False):
        state, collector, _, _ = setup(cfg, make_mesh(1, 1, 1, devices=jax.devices()[:1]), build.load_inputs(cfg))
        _, exp, metrics = collect(collector, state, PhaseTimer())
    sampled = exp.response_attention.astype(bool)  # this config has no environment: every response token counts
    batch = {"mask": sampled.astype(np.float64), "old_log_prob": exp.old_log_prob.astype(np.float64),
             "rollout_log_prob": exp.rollout_log_prob.astype(np.float64)}
    rejected = np_rejected(batch, RolloutCorrection("seq_rs", tau))
    sequences = sampled.any(1)
    assert 0 < rejected.sum() < sequences.sum()
    np.testing.assert_array_equal(exp.response_mask.astype(bool), sampled & ~rejected[:, None])
    assert metrics["rollout_corr/rejected_fraction"] == pytest.approx(rejected.sum() / sequences.sum())


@pytest.mark.parametrize("name", sorted(CORRECTIONS))
def test_every_mode_is_split_invariant(name):
    """Shares, gradients and metrics summed over the pieces of random cuts equal the whole batch's (as in
    test_losses_invariance, with the entropy and KL terms of the actor objective too), the rejection modes' rows
    cleared at collection, before the cut."""
    correction = CORRECTIONS[name]
    rows = 8
    run = objective(correction)
    for seed in (0, 1):
        batch = collected(_invariance_batch(seed), correction)
        padded = padding_row(batch)
        norm = global_norm_stats(jnp.asarray(batch["mask"]), C)
        whole = run({k: jnp.asarray(v) for k, v in batch.items()}, norm)
        for pieces in random_splits(seed):
            total = {mode: [0.0, np.zeros_like(batch["log_prob"]), []] for mode in AGG_MODES}
            for piece in pieces:
                index = np.concatenate([piece, np.full(rows - len(piece), rows)])
                out = run({k: jnp.asarray(v[index]) for k, v in padded.items()}, norm)
                for mode, ((share, metrics), grad) in out.items():
                    total[mode][0] += float(share)
                    total[mode][1][piece] += np.asarray(grad)[: len(piece)]
                    total[mode][2].append(metrics)
            for mode, ((share, metrics), grad) in whole.items():
                what = f"{name} {mode} seed={seed} pieces={[len(p) for p in pieces]}"
                assert np.isfinite(np.asarray(grad)).all(), what
                chex.assert_trees_all_close(total[mode][0], float(share), rtol=1e-10, atol=1e-12, custom_message=what)
                chex.assert_trees_all_close(total[mode][1], np.asarray(grad), rtol=1e-10, atol=1e-12,
                                            custom_message=what)
                chex.assert_trees_all_close(metrics_lib.reduce(total[mode][2]), metrics_lib.finish(metrics),
                                            rtol=1e-10, atol=1e-12, custom_message=what)


def test_the_engine_applies_the_correction_whatever_the_cut():
    """An actor step with geo_mask on 2 shards, one micro-batch vs token-budget packing: the same gradient as the
    whole-batch reference (which passes the same sampler log-probs to the loss), and the same metrics."""
    base = ragged_batch(3)
    rng = np.random.default_rng(3)
    offsets = rng.normal(0, 0.3, (base.num_sequences, 1))
    batch = dataclasses.replace(
        base, rollout_log_prob=np.where(base.response_attention, base.old_log_prob - offsets, 0.0)
    )
    correction = RolloutCorrection("geo_mask", 1.2)
    assert "rollout_log_prob" in loss_inputs(actor_cfg(rollout_correction=correction))
    mesh = mesh_of((2, 1, 1))
    results = [
        engine_step(CausalLM, actor_cfg(rollout_correction=correction, **per_shard(CUTS[cut], 2)), mesh, batch)
        for cut in ("K1", "token-budget")
    ]
    _, grads, _, ref_metrics = reference(CausalLM, actor_cfg(rollout_correction=correction), batch)
    expected = metrics_lib.finish(ref_metrics)
    assert 0 < float(expected["rollout_corr/masked_fraction"]) < 1
    _, uncorrected, _, _ = reference(CausalLM, actor_cfg(), batch)
    assert not np.allclose(jax.tree.leaves(grads)[0], jax.tree.leaves(uncorrected)[0])
    for _, metrics, gradient in results:
        chex.assert_trees_all_close(jax.device_get(gradient), jax.device_get(grads), rtol=1e-9)
        for key in ("rollout_corr/kl", "rollout_corr/ratio_mean", "rollout_corr/masked_fraction", "actor/pg_loss"):
            np.testing.assert_allclose(float(metrics[key]), float(expected[key]), rtol=1e-9, err_msg=key)


def test_the_config_carries_it_to_the_engine():
    cfg = load_config(ROOT / "configs" / "quickstart.yaml",
                      ["actor.rollout_correction.mode=seq_tis", "actor.rollout_correction.threshold=3"])
    view = engine_view(cfg, "actor")
    assert isinstance(view, ActorConfig) and view.rollout_correction == RolloutCorrection("seq_tis", 3.0)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["actor.rollout_correction.mode=tis"], "actor.rollout_correction.mode='tis' is not valid"),
        (["actor.rollout_correction.mode=geo_mask", "actor.rollout_correction.threshold=1"],
         "actor.rollout_correction.threshold=1.0 is invalid: it must be > 1 for mode 'geo_mask'"),
        (["actor.rollout_correction.mode=seq_rs", "actor.rollout_correction.threshold=0.5"],
         "actor.rollout_correction.threshold=0.5 is invalid: it must be > 1 for mode 'seq_rs'"),
        (["actor.rollout_correction.mode=geo_tis", "actor.rollout_correction.threshold=0"],
         "actor.rollout_correction.threshold=0.0 is invalid: it must be > 0 for mode 'geo_tis'"),
        (["actor.rollout_correction.mode=seq_mask"],
         "actor.rollout_correction.mode='seq_mask' was renamed 'geo_mask'"),
        (["actor.rollout_correction.mode=token_tis", "actor.rollout_correction.threshold=0"],
         "actor.rollout_correction.threshold=0.0 is invalid: it must be > 0 for mode 'token_tis'"),
        (["actor.rollout_correction.mode=seq_tis", "actor.rollout_correction.threshold=-2"],
         "actor.rollout_correction.threshold=-2.0 is invalid: it must be > 0 for mode 'seq_tis'"),
        (["rollout.dtype=bf16"], "rollout.dtype='bf16' is not valid (did you mean 'bfloat16'?)"),
        (["rollout.dtype=float64"], "rollout.dtype='float64' is not valid"),
    ],
)
def test_bad_settings_are_one_line_config_errors(overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config(ROOT / "configs" / "quickstart.yaml", overrides)
    text = str(error.value)
    assert message in text and "\n" not in text

