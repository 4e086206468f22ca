"""Parity of jppo's loss terms with values computed by verl's own functions (float64 golden vectors).

How verl's calls map onto jppo (docs/contract.md#checked-against-verls-own-functions):

- verl without global arguments ("local") == jppo with the call's own counts: ``N``, ``S`` = non-empty rows, and for
  ``seq-mean-token-sum-norm`` ``C`` = the padded width L = 16 (verl's default; jppo never defaults to a width, so
  the test passes it explicitly).
- verl ``global`` (``batch_num_tokens=N, global_batch_size=8``) == jppo with ``NormStats(N, 8, C)`` built as verl's
  call did (``C`` = 32 where verl passed ``loss_scale_factor=32``, else 16).
- verl ``dp2``/``dp2mb2`` slice == 2 x jppo's share of that slice (verl multiplies by dp_size because torch
  averages gradients over ranks; JAX sums them).
- verl ``naive_mb`` (pre-#6957 critic) == jppo's share of the slice normalized by the slice's own counts.
- Token-ratio metrics of a call are its masked means; verl's micro-batch metric == jppo's metric of that slice.

Deliberate differences, checked as our rule rather than verl's: ``S`` counts non-empty rows, so in case2 (one empty
row) every seq-mean value is verl's x 8/7 when jppo counts ``S`` itself; ``geo_mean`` goes through ``agg_loss``
(``seq-mean-token-mean`` reproduces verl's plain batch mean, again x 8/7 in case2, where verl's ``torch.mean``
counts the empty row); ``kl_cov`` is not implemented (its token selection depends on the micro-batch).

Tolerance: rtol 1e-6 because verl adds 1e-8 to several denominators (masked means, per-row token counts) that jppo
does not copy; float64 arithmetic otherwise agrees to ~1e-15. atol 1e-12 only for values that are exactly 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from golden import load_golden

from jppo.core import metrics as metrics_lib
from jppo.core.masked import NormStats, global_norm_stats
from jppo.losses import (
    AGG_MODES,
    KL_KINDS,
    POLICY_LOSSES,
    PolicyLossOptions,
    actor_loss,
    agg_loss,
    clipped_value_error,
    entropy_from_logits,
    entropy_loss,
    kl_loss,
    kl_penalty,
    penalize_rewards,
    policy_loss,
    value_loss,
)
from jppo.rewards.kl_penalty import AdaptiveKLController, FixedKLController

CASES = ("case0", "case1", "case2", "case3")
WIDTH = 16  # L of the golden data: verl's default loss_scale_factor
VERL_LSF = 32.0  # loss_scale_factor verl was given for the global / dp calls of seq-mean-token-sum-norm
VERL_GLOBAL_BATCH_SIZE = 8  # verl's nominal number of sequences (counts case2's empty row)
SEQ_MODES = ("seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# contiguous row slices of verl's dp=2 x micro-batch=2 split
SLICES = {
    "rank0/mb0": slice(0, 2),
    "rank0/mb1": slice(2, 4),
    "rank1/mb0": slice(4, 6),
    "rank1/mb1": slice(6, 8),
}
RANKS = {"rank0": slice(0, 4), "rank1": slice(4, 8)}
RTOL, ATOL = 1e-6, 1e-12

# (golden config name, jppo mode for verl's 'token-mean' label, options). verl forces seq-mean-token-mean inside
# gspo and sapo, and geo_mean's batch mean is jppo's seq-mean-token-mean.
VANILLA_CONFIGS = {
    "clip0.2_c3": dict(clip_ratio=0.2, clip_ratio_c=3.0),
    "clip0.2-0.28_c3": dict(clip_ratio=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0),
    "clip0.2_c1.5": dict(clip_ratio=0.2, clip_ratio_c=1.5),
}
OTHER_VARIANTS = {
    "gspo": ("seq-mean-token-mean", dict(clip_ratio_low=0.0003, clip_ratio_high=0.0004)),
    "sapo": ("seq-mean-token-mean", dict(tau_pos=1.0, tau_neg=1.05)),
    "gpg": ("token-mean", dict()),
    "geo_mean": ("seq-mean-token-mean", dict(clip_ratio=0.4)),
    "cispo": ("token-mean", dict(clip_ratio_low=10.0, clip_ratio_high=0.28)),
    "dro": ("token-mean", dict(dro_beta=0.05)),
    "dppo_tv": ("token-mean", dict(clip_ratio=0.2, clip_ratio_c=20.0)),
    "dppo_kl": ("token-mean", dict(clip_ratio=0.05, clip_ratio_c=20.0)),
}
NOT_IMPLEMENTED = ("kl_cov",)
PG_METRICS = ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower")


def _inputs(case: str) -> dict[str, jax.Array]:
    golden = load_golden()
    prefix = f"{case}/inputs/"
    return {key[len(prefix) :]: jnp.asarray(value) for key, value in golden.items() if key.startswith(prefix)}


def _own_counts(mask: jax.Array, lsf: float = WIDTH) -> NormStats:
    return global_norm_stats(mask, lsf)


def _verl_global(mask: jax.Array, lsf: float) -> NormStats:
    """NormStats as verl's global call had them: nominal batch size 8, even with an empty row."""
    return NormStats(jnp.sum(mask), jnp.asarray(float(VERL_GLOBAL_BATCH_SIZE)), jnp.asarray(lsf))


def _lsf(mode: str, given: float) -> float:
    return given if mode == "seq-mean-token-sum-norm" else float(WIDTH)


def _finished(metrics: dict[str, metrics_lib.Metric]) -> dict[str, np.ndarray]:
    return {name: np.asarray(value) for name, value in metrics_lib.finish(metrics).items()}


def _agg_family(case: str) -> dict[str, np.ndarray]:
    x = _inputs(case)
    loss_mat, mask = x["loss_mat"], x["response_mask"]
    out = {}
    for mode in AGG_MODES:
        base = f"{case}/agg_loss/{mode}/"
        out[base + "local"] = agg_loss(loss_mat, mask, mode, _own_counts(mask))
        verl_norm = _verl_global(mask, _lsf(mode, VERL_LSF))
        if mode == "seq-mean-token-sum-norm":
            out[base + "global_lsfNone"] = agg_loss(loss_mat, mask, mode, _verl_global(mask, WIDTH))
            out[base + "global_lsf32"] = agg_loss(loss_mat, mask, mode, verl_norm)
        else:
            out[base + "global"] = agg_loss(loss_mat, mask, mode, verl_norm)
        for rank, rows in RANKS.items():
            out[base + f"dp2/{rank}"] = 2 * agg_loss(loss_mat[rows], mask[rows], mode, verl_norm)
        for piece, rows in SLICES.items():
            out[base + f"dp2mb2/{piece}"] = 2 * agg_loss(loss_mat[rows], mask[rows], mode, verl_norm)
            out[base + f"naive_mb/{piece}"] = agg_loss(
                loss_mat[rows], mask[rows], mode, _own_counts(mask[rows], _lsf(mode, VERL_LSF))
            )
    return out


def _value_family(case: str) -> dict[str, np.ndarray]:
    x = _inputs(case)
    mask = x["response_mask"]
    out = {}
    for clip in (0.2, 0.5):
        base = f"{case}/value_loss/clip{clip}/"

        def call(rows, mode, norm):
            return value_loss(
                x["vpreds"][rows], x["values"][rows], x["returns"][rows], mask[rows],
                cliprange_value=clip, mode=mode, norm=norm,
            )

        everything = slice(None)
        for mode in AGG_MODES:
            share, metrics = call(everything, mode, _own_counts(mask))
            out[base + f"{mode}/local/vf_loss"] = share
            out[base + f"{mode}/local/vf_clipfrac"] = _finished(metrics)["critic/vf_clipfrac"]
            verl_norm = _verl_global(mask, _lsf(mode, VERL_LSF))
            out[base + f"{mode}/global/vf_loss"] = call(everything, mode, verl_norm)[0]
            for piece, rows in SLICES.items():
                share, metrics = call(rows, mode, verl_norm)
                out[base + f"{mode}/dp2mb2/{piece}/vf_loss"] = 2 * share
                out[base + f"{mode}/dp2mb2/{piece}/vf_clipfrac"] = _finished(metrics)["critic/vf_clipfrac"]
        out[base + "grad_vpreds_token-mean_local"] = jax.grad(
            lambda vpreds: value_loss(
                vpreds, x["values"], x["returns"], mask, cliprange_value=clip, mode="token-mean",
                norm=_own_counts(mask),
            )[0]
        )(x["vpreds"])
        out[base + "per_token"] = 0.5 * clipped_value_error(x["vpreds"], x["values"], x["returns"], clip)[0]
    return out


def _policy_call(x, name, rows, mode, norm, options, *, with_grad=True):
    def share_and_metrics(log_prob):
        return policy_loss(
            name, log_prob, x["old_log_prob"][rows], x["advantages"][rows], x["response_mask"][rows],
            mode=mode, norm=norm, **options,
        )

    if not with_grad:
        share, metrics = share_and_metrics(x["log_prob"][rows])
        return share, _finished(metrics), None
    (share, metrics), grad = jax.value_and_grad(share_and_metrics, has_aux=True)(x["log_prob"][rows])
    return share, _finished(metrics), grad


def _policy_family(case: str) -> dict[str, np.ndarray]:
    x = _inputs(case)
    mask = x["response_mask"]
    everything = slice(None)
    out = {}
    for config, options in VANILLA_CONFIGS.items():
        base = f"{case}/policy_loss/vanilla/{config}/"
        for mode in AGG_MODES:
            share, metrics, grad = _policy_call(x, "vanilla", everything, mode, _own_counts(mask), options)
            out[base + f"{mode}/pg_loss"] = share
            out[base + f"{mode}/grad_log_prob"] = grad
            for name in PG_METRICS:
                out[base + f"{mode}/{name}"] = metrics[f"actor/{name}"]
            verl_norm = _verl_global(mask, _lsf(mode, VERL_LSF))
            for piece, rows in SLICES.items():
                share, metrics, _ = _policy_call(x, "vanilla", rows, mode, verl_norm, options, with_grad=False)
                out[base + f"{mode}/dp2mb2/{piece}/pg_loss"] = 2 * share
                out[base + f"{mode}/dp2mb2/{piece}/pg_clipfrac"] = metrics["actor/pg_clipfrac"]
        per_token = POLICY_LOSSES["vanilla"](
            x["log_prob"], x["old_log_prob"], x["advantages"], mask.astype(bool), PolicyLossOptions.create(**options)
        )
        out[base + "per_token"] = per_token.loss
    golden = load_golden()
    for name, (mode, options) in OTHER_VARIANTS.items():
        base = f"{case}/policy_loss/{name}/token-mean/"
        share, metrics, grad = _policy_call(x, name, everything, mode, _own_counts(mask), options)
        # verl reports a subset of the metrics for some variants (gpg: none, dro: ppo_kl); compare what exists.
        candidates = {"pg_loss": share, "grad_log_prob": grad} | {m: metrics[f"actor/{m}"] for m in PG_METRICS}
        out |= {base + key: value for key, value in candidates.items() if base + key in golden}
    return out


def _kl_family(case: str) -> dict[str, np.ndarray]:
    x = _inputs(case)
    mask = x["response_mask"]
    out = {}
    for kind in KL_KINDS:
        if f"{case}/kl_penalty/{kind}/value" not in load_golden():
            continue  # verl's golden set has the "+" kinds only for k1, k3, low_var_kl, abs
        base = f"{case}/kl_penalty/{kind}/"
        out[base + "value"] = kl_penalty(x["log_prob"], x["ref_log_prob"], kind)
        out[base + "grad_sum"] = jax.grad(
            lambda log_prob: kl_loss(
                log_prob, x["ref_log_prob"], mask, kind=kind, mode="token-sum", norm=_own_counts(mask)
            )[0]
        )(x["log_prob"])
        out[base + "agg_token-mean"] = kl_loss(
            x["log_prob"], x["ref_log_prob"], mask, kind=kind, mode="token-mean", norm=_own_counts(mask)
        )[0]
    return out


def _rewards_family(case: str) -> dict[str, np.ndarray]:
    x = _inputs(case)
    rewards, _ = penalize_rewards(
        x["token_level_rewards"], x["old_log_prob"], x["ref_log_prob"], x["response_mask"], kl_coef=0.1, kind="kl"
    )
    return {f"{case}/compute_rewards/kl_ratio0.1": rewards}


def _entropy_family(case: str) -> dict[str, np.ndarray]:
    x = _inputs(case)
    mask = x["response_mask"]
    entropy = entropy_from_logits(x["logits"])
    out = {f"{case}/entropy/per_token": entropy}
    for mode in AGG_MODES:
        out[f"{case}/entropy/agg/{mode}"] = entropy_loss(entropy, mask, mode=mode, norm=_own_counts(mask))[0]
    return out


FAMILIES = {
    "agg_loss": _agg_family,
    "value_loss": _value_family,
    "policy_loss": _policy_family,
    "kl_penalty": _kl_family,
    "compute_rewards": _rewards_family,
    "entropy": _entropy_family,
}
# Families compared only under the mask: jppo's KL-in-reward leaves padded positions at the raw score.
MASKED_ONLY = ("compute_rewards",)


@functools.cache
def ours(case: str, family: str) -> dict[str, np.ndarray]:
    with jax.enable_x64(True):
        return {key: np.asarray(value) for key, value in FAMILIES[family](case).items()}


def _deliberate_difference(case: str, key: str) -> float:
    """Factor jppo's value carries relative to verl's where the contract deliberately differs (else 1)."""
    golden = load_golden()
    nonempty = float(golden[f"{case}/meta/num_nonempty_seqs"])
    # geo_mean: verl's torch.mean counts all rows; jppo's seq-mean counts non-empty rows.
    if "/policy_loss/geo_mean/" in key and key.rsplit("/", 1)[-1] in ("pg_loss", "grad_log_prob"):
        return VERL_GLOBAL_BATCH_SIZE / nonempty
    return 1.0


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("case", CASES)
def test_matches_verl(case, family):
    golden = load_golden()
    mask = golden[f"{case}/inputs/response_mask"].astype(bool)
    failures = []
    for key, value in ours(case, family).items():
        expected = golden[key] * _deliberate_difference(case, key)
        if family in MASKED_ONLY:
            value, expected = value[mask], expected[mask]
        if value.shape != expected.shape or not np.allclose(value, expected, rtol=RTOL, atol=ATOL):
            failures.append(f"{key}: jppo {value.ravel()[:4]} verl {expected.ravel()[:4]}")
    assert not failures, f"{len(failures)} mismatches:\n" + "\n".join(failures[:20])


@pytest.mark.parametrize("case", CASES)
def test_every_golden_loss_key_is_compared(case):
    """No golden key of the loss families is silently skipped (apart from the variants jppo does not have)."""
    golden = load_golden()
    prefixes = tuple(f"{case}/{family}/" for family in FAMILIES)
    skipped = tuple(f"{case}/policy_loss/{name}/" for name in NOT_IMPLEMENTED)
    wanted = {key for key in golden if key.startswith(prefixes) and not key.startswith(skipped)}
    compared = set().union(*(ours(case, family) for family in FAMILIES))
    assert compared == wanted, f"missing: {sorted(wanted - compared)[:10]}; unknown: {sorted(compared - wanted)[:10]}"


def test_geo_mean_case2_differs_from_verl_by_the_empty_row():
    """case2 has one empty row: verl's GMPO divides by all 8 rows, jppo by the 7 sequences (and the test above
    checks ours == verl x 8/7); the other cases have no empty row and match verl unscaled."""
    golden = load_golden()
    ratio = ours("case2", "policy_loss")["case2/policy_loss/geo_mean/token-mean/pg_loss"] / golden[
        "case2/policy_loss/geo_mean/token-mean/pg_loss"
    ]
    np.testing.assert_allclose(ratio, 8 / 7, rtol=RTOL)
    for case in ("case0", "case1", "case3"):
        key = f"{case}/policy_loss/geo_mean/token-mean/pg_loss"
        np.testing.assert_allclose(ours(case, "policy_loss")[key], golden[key], rtol=RTOL)


@pytest.mark.parametrize("case", CASES)
def test_agg_loss_with_jppo_counts(case):
    """jppo's own rule for S: rows with at least one valid token. verl's nominal global_batch_size=8 counts case2's
    empty row, so there jppo's seq-mean values are verl's x 8/7; token modes and the other cases agree as they are."""
    golden = load_golden()
    nonempty = float(golden[f"{case}/meta/num_nonempty_seqs"])
    with jax.enable_x64(True):
        x = _inputs(case)
        norm = global_norm_stats(x["response_mask"], VERL_LSF)
        assert float(norm.num_seqs) == nonempty
        for mode in AGG_MODES:
            key = f"{case}/agg_loss/{mode}/" + ("global_lsf32" if mode == "seq-mean-token-sum-norm" else "global")
            factor = VERL_GLOBAL_BATCH_SIZE / nonempty if mode in SEQ_MODES else 1.0
            share = agg_loss(x["loss_mat"], x["response_mask"], mode, norm)
            np.testing.assert_allclose(np.asarray(share), golden[key] * factor, rtol=RTOL, err_msg=key)
    if case == "case2":
        assert nonempty == 7


def test_kl_controllers_match_verl():
    golden = load_golden()
    with jax.enable_x64(True):
        adaptive = AdaptiveKLController(init_kl_coef=0.2, target_kl=6.0, horizon=10000)
        state = adaptive.init()
        values = []
        for current_kl in golden["kl_ctrl/adaptive/current_kl_seq"]:
            state = jax.jit(adaptive.update)(state, current_kl, 256)
            values.append(float(state.coef))
        fixed = FixedKLController(kl_coef=0.001)
        fixed_value = float(fixed.update(fixed.init(), 10.0, 256).coef)
    # float64 throughout; the recurrence has 6 multiplications, so agreement is to ~1e-15.
    np.testing.assert_allclose(values, golden["kl_ctrl/adaptive/values"], rtol=1e-12)
    np.testing.assert_allclose(fixed_value, golden["kl_ctrl/fixed/value"], rtol=1e-12)


@pytest.mark.parametrize("case", CASES)
def test_actor_loss_composes_verl_terms(case):
    """actor = pg - entropy_coeff * entropy + kl_loss_coef * kl, each term as verl aggregates it (token-mean)."""
    golden = load_golden()
    entropy_coeff, kl_loss_coef = 0.01, 0.1
    with jax.enable_x64(True):
        x = _inputs(case)
        share, metrics = actor_loss(
            x["log_prob"], x["old_log_prob"], x["advantages"], x["response_mask"],
            norm=_own_counts(x["response_mask"]), mode="token-mean",
            policy_loss_name="vanilla", policy_options=PolicyLossOptions(clip_ratio=0.2, clip_ratio_c=3.0),
            entropy=jnp.asarray(golden[f"{case}/entropy/per_token"]), entropy_coeff=entropy_coeff,
            ref_log_prob=x["ref_log_prob"], kl_loss_coef=kl_loss_coef, kl_loss_type="low_var_kl",
        )
        finished = _finished(metrics)
    pg = golden[f"{case}/policy_loss/vanilla/clip0.2_c3/token-mean/pg_loss"]
    entropy = golden[f"{case}/entropy/agg/token-mean"]
    kl = golden[f"{case}/kl_penalty/low_var_kl/agg_token-mean"]
    np.testing.assert_allclose(float(share), pg - entropy_coeff * entropy + kl_loss_coef * kl, rtol=RTOL)
    np.testing.assert_allclose(
        [finished["actor/pg_loss"], finished["actor/entropy"], finished["actor/kl_loss"]], [pg, entropy, kl], rtol=RTOL
    )
    assert set(finished) == {f"actor/{m}" for m in ("pg_loss", *PG_METRICS, "entropy", "kl_loss")}


def test_kl_in_reward_leaves_padded_scores_alone():
    """jppo's rule where verl has none (verl's compute_rewards is unmasked): no KL at padded positions, so case2's
    empty row keeps its outcome score (at position L-1, mask 0) for sequence-level advantage estimators."""
    golden = load_golden()
    with jax.enable_x64(True):
        x = _inputs("case2")
        rewards, kl = penalize_rewards(
            x["token_level_rewards"], x["old_log_prob"], x["ref_log_prob"], x["response_mask"], kl_coef=0.1
        )
    padded = golden["case2/inputs/response_mask"] == 0
    scores = golden["case2/inputs/token_level_rewards"]
    assert scores[3, -1] != 0 and padded[3, -1]
    np.testing.assert_array_equal(np.asarray(rewards)[padded], scores[padded])
    assert not np.asarray(kl)[padded].any()


def _numpy_entropy(logits: np.ndarray) -> np.ndarray:
    finite = np.isfinite(logits)
    z = np.where(finite, logits, -np.inf).astype(np.float64)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1)), 0), axis=-1)


def test_entropy_beyond_the_golden_data():
    """bfloat16 logits are computed in float32 (result within float32 rounding of the exact entropy of the
    bf16-rounded logits: rtol 1e-5); -inf vocabulary entries count as probability 0 and get a zero gradient."""
    logits = np.asarray(load_golden()["case0/inputs/logits"])[:2]  # [2, 16, 5]
    logits_bf16 = jnp.asarray(logits, jnp.bfloat16)
    entropy = entropy_from_logits(logits_bf16)
    assert entropy.dtype == jnp.float32
    np.testing.assert_allclose(entropy, _numpy_entropy(np.asarray(logits_bf16, np.float64)), rtol=1e-5)

    vocabulary_masked = logits.astype(np.float32).copy()
    vocabulary_masked[..., 1] = -np.inf
    entropy, grad = jax.value_and_grad(lambda z: jnp.sum(entropy_from_logits(z)))(jnp.asarray(vocabulary_masked))
    np.testing.assert_allclose(entropy, _numpy_entropy(vocabulary_masked).sum(), rtol=1e-5)
    grad = np.asarray(grad)
    assert np.isfinite(grad).all() and not grad[..., 1].any()
