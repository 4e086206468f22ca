"""The contract: summed over the micro-batches of any cut, shares, gradients and metrics equal the whole batch's.

For every loss term and every aggregation mode: random ragged masks (an empty row, a single-token row, interior
holes), NaN/Inf planted at every masked position of every input, rows cut at random into K pieces of uneven size
(some empty or fully masked). Each piece is padded to the batch's row count with fully masked NaN rows, so one
compiled function serves the whole batch and every piece; the padding must contribute exactly 0.

Tolerance: float64; the pieces sum the same terms in another order, so agreement is to a few ulps of O(1)
values (rtol 1e-10, and atol 1e-12 for entries that are 0 in one computation and ~1e-17 in the other).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jppo.core import metrics as metrics_lib
from jppo.core.masked import global_norm_stats
from jppo.losses import (
    AGG_MODES,
    POLICY_LOSSES,
    PolicyLossOptions,
    actor_loss,
    entropy_from_logits,
    entropy_loss,
    kl_loss,
    policy_loss,
    value_loss,
)

ROWS, LENGTH, VOCAB = 8, 6, 4
SEEDS = (0, 1, 2)
SPLITS = (1, 2, 3, 4, 8)
LOSS_SCALE_FACTOR = 10.0
RTOL, ATOL = 1e-10, 1e-12
KL_KINDS_TESTED = ("kl", "abs+", "low_var_kl", "k3+")
# Options a variant needs to run or to exercise its clipping on this data.
VARIANT_OPTIONS = {
    "vanilla": dict(clip_ratio_high=0.28, clip_ratio_c=1.3),
    "dro": dict(dro_beta=0.1),
    "dppo_tv": dict(clip_ratio=0.05, clip_ratio_c=1.3),
    "dppo_kl": dict(clip_ratio=0.02, clip_ratio_c=1.3),
}


def make_batch(seed: int) -> dict[str, np.ndarray]:
    """Ragged float64 batch (rows shuffled): one empty row, one single-token row, one row with an interior hole,
    random holes elsewhere; NaN/Inf under the mask."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, LENGTH + 1, ROWS)
    lengths[0], lengths[1] = 0, 1
    mask = (np.arange(LENGTH) < lengths[:, None]) & (rng.random((ROWS, LENGTH)) > 0.2)
    mask[1] = np.arange(LENGTH) == rng.integers(LENGTH)
    mask[2] = np.arange(LENGTH) != rng.integers(1, LENGTH - 1)  # full row but for one interior hole
    mask = mask[rng.permutation(ROWS)]
    log_prob = -rng.exponential(0.7, (ROWS, LENGTH))
    batch = {
        "mask": mask.astype(np.float64),
        "log_prob": log_prob,
        # wide enough that every clip / trust-region branch is taken; still valid log-probabilities (<= 0)
        "old_log_prob": np.minimum(log_prob + rng.normal(0, 0.4, (ROWS, LENGTH)), -1e-3),
        "ref_log_prob": np.minimum(log_prob + rng.normal(0, 0.4, (ROWS, LENGTH)), -1e-3),
        "advantages": rng.normal(size=(ROWS, LENGTH)),
        "vpreds": rng.normal(size=(ROWS, LENGTH)),
        "values": rng.normal(size=(ROWS, LENGTH)),
        "returns": rng.normal(size=(ROWS, LENGTH)),
        "entropy": rng.uniform(0, 2, (ROWS, LENGTH)),
        "logits": rng.normal(size=(ROWS, LENGTH, VOCAB)),
    }
    garbage = rng.choice([np.nan, np.inf, -np.inf], (ROWS, LENGTH))
    for name, array in batch.items():
        if name != "mask":
            under_mask = mask if array.ndim == 2 else mask[..., None]
            batch[name] = np.where(under_mask, array, garbage if array.ndim == 2 else garbage[..., None])
    return batch


def padding_row(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The batch with one extra row: fully masked, NaN everywhere (the filler of every piece)."""
    return {
        name: np.concatenate([array, np.zeros_like(array[:1]) if name == "mask" else np.full_like(array[:1], np.nan)])
        for name, array in batch.items()
    }


def random_splits(seed: int) -> list[list[np.ndarray]]:
    """For each K in SPLITS, K row-index sets of random, uneven sizes (possibly empty) covering every row once."""
    rng = np.random.default_rng(1000 + seed)
    return [np.split(rng.permutation(ROWS), np.sort(rng.integers(0, ROWS + 1, k - 1))) for k in SPLITS]


def _policy_term(name: str):
    options = VARIANT_OPTIONS.get(name, {})

    def term(x, mode, norm):
        def share(log_prob):
            return policy_loss(
                name, log_prob, x["old_log_prob"], x["advantages"], x["mask"], mode=mode, norm=norm, **options
            )

        return jax.value_and_grad(share, has_aux=True)(x["log_prob"])

    return term


def _value_term(x, mode, norm):
    def share(vpreds):
        return value_loss(vpreds, x["values"], x["returns"], x["mask"], cliprange_value=0.2, mode=mode, norm=norm)

    return jax.value_and_grad(share, has_aux=True)(x["vpreds"])


def _entropy_term(x, mode, norm):
    def share(logits):
        return entropy_loss(entropy_from_logits(logits, x["mask"]), x["mask"], mode=mode, norm=norm)

    return jax.value_and_grad(share, has_aux=True)(x["logits"])


def _kl_term(x, mode, norm):
    def share(log_prob):
        total, metrics = 0.0, {}
        for kind in KL_KINDS_TESTED:
            kind_share, kind_metrics = kl_loss(log_prob, x["ref_log_prob"], x["mask"], kind=kind, mode=mode, norm=norm)
            total = total + kind_share
            metrics |= {f"{name}/{kind}": metric for name, metric in kind_metrics.items()}
        return total, metrics

    return jax.value_and_grad(share, has_aux=True)(x["log_prob"])


def _actor_term(x, mode, norm):
    def share(log_prob):
        return actor_loss(
            log_prob, x["old_log_prob"], x["advantages"], x["mask"], norm=norm, mode=mode,
            policy_loss_name="vanilla", policy_options=PolicyLossOptions(clip_ratio_high=0.28, clip_ratio_c=2.0),
            entropy=x["entropy"], entropy_coeff=0.01, ref_log_prob=x["ref_log_prob"], kl_loss_coef=0.1,
            kl_loss_type="k3+",
        )

    return jax.value_and_grad(share, has_aux=True)(x["log_prob"])


TERMS = {
    "value": (_value_term, "vpreds"),
    "entropy": (_entropy_term, "logits"),
    "kl": (_kl_term, "log_prob"),
    "actor": (_actor_term, "log_prob"),
} | {f"policy/{name}": (_policy_term(name), "log_prob") for name in sorted(POLICY_LOSSES)}


def _all_modes(term):
    """One compiled function per term: every mode at once, for the whole batch and every padded piece."""

    @jax.jit
    def run(x, norm):
        return {mode: term(x, mode, norm) for mode in AGG_MODES}

    return run


def _close(actual, expected, what: str) -> None:
    try:
        chex.assert_trees_all_close(actual, expected, rtol=RTOL, atol=ATOL)
    except AssertionError as error:
        raise AssertionError(f"{what}: {error}") from None


@pytest.mark.parametrize("term_name", sorted(TERMS))
def test_split_invariance(term_name):
    term, wrt = TERMS[term_name]
    run = _all_modes(term)
    with jax.enable_x64(True):
        for seed in SEEDS:
            batch = make_batch(seed)
            padded = padding_row(batch)
            norm = global_norm_stats(jnp.asarray(batch["mask"]), LOSS_SCALE_FACTOR)
            whole = run({name: jnp.asarray(a) for name, a in batch.items()}, norm)
            for mode, ((share, metrics), grad) in whole.items():
                grad = np.asarray(grad)
                assert np.isfinite(grad).all() and np.isfinite(float(share)), f"{term_name} {mode}: NaN leaked"
                masked_out = batch["mask"] == 0
                assert not grad[masked_out].any(), f"{term_name} {mode}: gradient at masked positions"
            for pieces in random_splits(seed):
                shares = {mode: 0.0 for mode in AGG_MODES}
                grads = {mode: np.zeros_like(batch[wrt]) for mode in AGG_MODES}
                piece_metrics = {mode: [] for mode in AGG_MODES}
                for rows in pieces:
                    index = np.concatenate([rows, np.full(ROWS - len(rows), ROWS)])  # ROWS = the padding row
                    out = run({name: jnp.asarray(a[index]) for name, a in padded.items()}, norm)
                    for mode, ((share, metrics), grad) in out.items():
                        grad = np.asarray(grad)
                        assert not grad[len(rows) :].any(), f"{term_name} {mode}: padding rows got a gradient"
                        if len(rows) == 0 or not batch["mask"][rows].any():
                            assert float(share) == 0.0, f"{term_name} {mode}: a fully masked piece has a share"
                        shares[mode] += float(share)
                        grads[mode][rows] += grad[: len(rows)]
                        piece_metrics[mode].append(metrics)
                for mode, ((share, metrics), grad) in whole.items():
                    what = f"{term_name} mode={mode} seed={seed} pieces={[len(r) for r in pieces]}"
                    _close(shares[mode], float(share), what + " share")
                    _close(grads[mode], np.asarray(grad), what + f" d/d{wrt}")
                    _close(metrics_lib.reduce(piece_metrics[mode]), metrics_lib.finish(metrics), what + " metrics")


def test_batches_and_splits_cover_the_edge_cases():
    """The generators really produce what the contract worries about: an empty row, a single-token row, interior
    holes, garbage under the mask, and pieces that are empty or hold only fully masked rows."""
    empty_pieces = masked_pieces = 0
    for seed in SEEDS:
        batch = make_batch(seed)
        lengths = batch["mask"].sum(axis=1)
        assert (lengths == 0).sum() == 1 and (lengths == 1).sum() >= 1
        assert any(0 < np.flatnonzero(row).size < np.ptp(np.flatnonzero(row)) + 1 for row in batch["mask"])
        assert np.isnan(batch["log_prob"][batch["mask"] == 0]).any()
        for pieces in random_splits(seed):
            assert sorted(np.concatenate(pieces)) == list(range(ROWS))
            empty_pieces += sum(len(rows) == 0 for rows in pieces)
            masked_pieces += sum(len(rows) > 0 and not batch["mask"][rows].any() for rows in pieces)
    assert empty_pieces > 0 and masked_pieces > 0
