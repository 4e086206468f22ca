"""Split invariance of every loss function, checked both under ``jax.jit`` and eagerly (``chex.variants``).

For one ragged float64 batch (an empty row, a single-token row, an interior hole, NaN at every masked position of
every input) the rows are cut into pieces of 3, 0, 1 and 4 rows (the 1-row piece is the empty row, so it is fully
masked). Every piece is aggregated with the WHOLE batch's ``NormStats``; the pieces' shares, gradients and metrics
must then add up to the whole batch's (rtol 1e-10, atol 1e-12 as in ``test_losses_invariance.py``).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import parameterized
from test_losses_invariance import LENGTH, ROWS, VARIANT_OPTIONS
from test_losses_invariance import make_batch as ragged_batch

from jppo.core import metrics as metrics_lib
from jppo.core.masked import global_norm_stats
from jppo.losses import (
    AGG_MODES,
    KL_KINDS,
    POLICY_LOSSES,
    REQUIRED_AGG_MODES,
    PolicyLossOptions,
    actor_loss,
    agg_loss,
    entropy_loss,
    kl_loss,
    policy_loss,
    value_loss,
)

CUT = (3, 0, 1, 4)  # piece sizes; the empty row is placed in the 1-row piece
LOSS_SCALE_FACTOR = 10.0
RTOL, ATOL = 1e-10, 1e-12


def make_batch(seed: int = 0) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The ragged float64 batch of ``test_losses_invariance`` (NaN/Inf under the mask) plus a per-token ``loss``,
    and the row order in which it is cut (see ``CUT``)."""
    batch = ragged_batch(seed)
    rng = np.random.default_rng(seed + 1000)
    batch["loss"] = np.where(batch["mask"] > 0, rng.normal(size=(ROWS, LENGTH)), np.nan)
    empty = int(np.flatnonzero(batch["mask"].sum(axis=1) == 0)[0])
    others = rng.permutation([row for row in range(ROWS) if row != empty])
    order = np.concatenate([others[:3], [empty], others[3:]])  # the empty row is the whole 1-row piece
    return batch, order


def _agg(mode):
    def term(x, norm):
        share = agg_loss(x["loss"], x["mask"], mode, norm)
        return share, {"agg": metrics_lib.loss_share(share, x["mask"], norm)}

    return "loss", term


def _value(mode):
    return "vpreds", lambda x, norm: value_loss(
        x["vpreds"], x["values"], x["returns"], x["mask"], cliprange_value=0.2, mode=mode, norm=norm
    )


def _policy(name, mode):
    options = VARIANT_OPTIONS.get(name, {})
    return "log_prob", lambda x, norm: policy_loss(
        name, x["log_prob"], x["old_log_prob"], x["advantages"], x["mask"], mode=mode, norm=norm, **options
    )


def _entropy(mode):
    return "entropy", lambda x, norm: entropy_loss(x["entropy"], x["mask"], mode=mode, norm=norm)


def _kl(kind, mode):
    return "log_prob", lambda x, norm: kl_loss(
        x["log_prob"], x["ref_log_prob"], x["mask"], kind=kind, mode=mode, norm=norm
    )


def _actor(mode):
    return "log_prob", lambda x, norm: actor_loss(
        x["log_prob"], x["old_log_prob"], x["advantages"], x["mask"], norm=norm, mode=mode,
        policy_loss_name="vanilla", policy_options=PolicyLossOptions(clip_ratio_high=0.28, clip_ratio_c=2.0),
        entropy=x["entropy"], entropy_coeff=0.01, ref_log_prob=x["ref_log_prob"], kl_loss_coef=0.1,
        kl_loss_type="k3+",
    )


def _cycle(i: int) -> str:
    return AGG_MODES[i % len(AGG_MODES)]


# (name, builder): every mode for agg/value/entropy, one for the (slow to compile) actor; every policy variant and
# some KL kinds with a mode cycled over AGG_MODES (gspo and geo_mean with the mode they require).
ACTOR_MODES = ("seq-mean-token-mean",)
KL_KINDS_TESTED = ("kl", "k2+", "mse", "low_var_kl", "k3+")
assert set(KL_KINDS_TESTED) <= set(KL_KINDS)
CASES = (
    [(f"agg_{mode}", lambda m=mode: _agg(m)) for mode in AGG_MODES]
    + [(f"value_{mode}", lambda m=mode: _value(m)) for mode in AGG_MODES]
    + [(f"entropy_{mode}", lambda m=mode: _entropy(m)) for mode in AGG_MODES]
    + [(f"actor_{mode}", lambda m=mode: _actor(m)) for mode in ACTOR_MODES]
    + [
        (f"policy_{name}_{REQUIRED_AGG_MODES.get(name, _cycle(i))}",
         lambda n=name, m=REQUIRED_AGG_MODES.get(name, _cycle(i)): _policy(n, m))
        for i, name in enumerate(sorted(POLICY_LOSSES))
    ]
    + [(f"kl_{kind}_{_cycle(i)}", lambda k=kind, m=_cycle(i): _kl(k, m)) for i, kind in enumerate(KL_KINDS_TESTED)]
)


class LossVariantsTest(chex.TestCase):
    def setUp(self):
        super().setUp()
        self.enter_context(jax.enable_x64(True))

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(*CASES)
    def test_split_invariance(self, build):
        wrt, term = build()
        traced = []

        def value_and_grad(main, rest, norm):
            traced.append(isinstance(main, jax.core.Tracer))

            def share(main):
                return term(rest | {wrt: main}, norm)

            return jax.value_and_grad(share, has_aux=True)(main)

        run = self.variant(value_and_grad)  # mode, variant name and options are closed over, not traced
        batch, order = make_batch()
        as_jax = lambda rows: {name: jnp.asarray(array[rows]) for name, array in batch.items()}  # noqa: E731
        norm = global_norm_stats(jnp.asarray(batch["mask"]), LOSS_SCALE_FACTOR)
        whole = as_jax(np.arange(ROWS))
        (whole_share, whole_metrics), whole_grad = run(whole.pop(wrt), whole, norm)
        chex.assert_shape(whole_grad, (ROWS, LENGTH))
        chex.assert_tree_all_finite((whole_share, whole_grad, metrics_lib.finish(whole_metrics)))
        self.assertFalse(np.asarray(whole_grad)[batch["mask"] == 0].any(), "gradient at masked positions")

        total_share, total_grad, piece_metrics = 0.0, np.zeros((ROWS, LENGTH)), []
        for rows in np.split(order, np.cumsum(CUT)[:-1]):
            piece = as_jax(rows)
            (share, metrics), grad = run(piece.pop(wrt), piece, norm)  # the WHOLE batch's NormStats
            chex.assert_shape(grad, (len(rows), LENGTH))
            chex.assert_tree_all_finite((share, grad))
            if not batch["mask"][rows].any():
                self.assertEqual(float(share), 0.0, "a fully masked piece has a share")
            total_share += share
            total_grad[rows] += np.asarray(grad)
            piece_metrics.append(metrics)

        chex.assert_trees_all_close(total_share, whole_share, rtol=RTOL, atol=ATOL)
        chex.assert_trees_all_close(total_grad, np.asarray(whole_grad), rtol=RTOL, atol=ATOL)
        chex.assert_trees_all_close(
            metrics_lib.reduce(piece_metrics), metrics_lib.finish(whole_metrics), rtol=RTOL, atol=ATOL
        )
        # the variant really is what its name says: traced under jit, concrete arrays without it
        self.assertTrue(traced)
        self.assertEqual(set(traced), {self.variant.type == chex.ChexVariantType.WITH_JIT})
        self.assertEqual(whole_share.dtype, jnp.float64)
