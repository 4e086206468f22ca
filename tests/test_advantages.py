"""Advantage estimators: parity with verl's golden vectors, plus the rules jppo adds (masked sums, empty rows,
groups of one, NaN at masked positions, arbitrary group ids).

Tolerances: against verl rtol 1e-6 with atol 1e-8 (docs/contract.md#checked-against-verls-own-functions): verl divides
masked means by ``N + 1e-8``, which moves whitened values by ~1e-10 absolute, so values near 0 need the absolute floor.
Between two jppo runs that only reorder float64 sums, rtol 1e-12.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest
from golden import load_golden

from jppo.advantages import ADVANTAGE_ESTIMATORS, run_estimator
from jppo.core.masked import masked_mean, masked_var, masked_whiten

CASES = ("case0", "case1", "case2", "case3")
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline", "opo", "gpg", "grpo_passk")
# verl's pass@k golden vectors were computed with these group ids (not the case's own index).
PASSK_INDEX = np.array([0, 0, 0, 0, 1, 1, 1, 1])
VERL_RTOL, VERL_ATOL = 1e-6, 1e-8
REORDER_RTOL = 1e-12


@pytest.fixture(autouse=True)
def _float64():
    with jax.enable_x64(True):
        yield


def golden_inputs(case: str) -> dict[str, np.ndarray]:
    prefix = f"{case}/inputs/"
    return {key[len(prefix) :]: value for key, value in load_golden().items() if key.startswith(prefix)}


@functools.partial(jax.jit, static_argnames=("name", "options"))
def run_jitted(name: str, arrays: dict, options: tuple = ()) -> tuple[jax.Array, jax.Array]:
    """One compilation per estimator and static option set; gamma / lam travel as traced scalars."""
    return run_estimator(name, **arrays, **dict(options))


def estimator_arrays(name: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The golden inputs an estimator takes, named as its parameters."""
    estimator = ADVANTAGE_ESTIMATORS[name]
    dense = name in ("gae", "reinforce_plus_plus")  # verl's golden runs these on the dense rewards
    arrays = {
        "token_level_rewards": inputs["token_level_rewards_dense" if dense else "token_level_rewards"],
        "mask": inputs["response_mask"],
    }
    if estimator.needs_critic:
        arrays["values"] = inputs["values"]
    if estimator.needs_group_ids:
        arrays["group_ids"] = PASSK_INDEX if name == "grpo_passk" else inputs["index"]
    if estimator.needs_reward_baselines:
        arrays["reward_baselines"] = inputs["reward_baselines"]
    return arrays


# ----------------------------------------------------------------------------------------------- verl's rows


def group_rows_as_verl(mask: np.ndarray, group_ids: np.ndarray, singletons_agree: bool = False) -> np.ndarray:
    """Rows whose group is the same under jppo's rules and verl's: no empty row in it, and (unless verl also
    gives a group of one 0) at least two rows. verl counts an empty row (and its unmasked score) in its group and
    gives a group of one its raw score; jppo does neither (checked by the rule tests below)."""
    non_empty = mask.sum(axis=1) > 0
    same = group_ids[:, None] == group_ids[None, :]
    no_empty_member = ~np.any(same & ~non_empty[None, :], axis=1)
    return no_empty_member if singletons_agree else no_empty_member & (same.sum(axis=1) > 1)


def gpg_rows_as_verl(mask: np.ndarray, group_ids: np.ndarray, rewards: np.ndarray) -> np.ndarray:
    """GPG scales by alpha = rows / rows with a non-zero score; verl counts all rows and unmasked sums, jppo
    non-empty rows and masked sums. Rows compare only where both the group and alpha agree."""
    non_empty = mask.sum(axis=1) > 0
    alpha_verl = len(rewards) / max(np.count_nonzero(rewards.sum(axis=1)), 1)
    masked_scores = np.where(mask > 0, rewards, 0).sum(axis=1)
    alpha_jppo = non_empty.sum() / max(np.count_nonzero(masked_scores[non_empty]), 1)
    return group_rows_as_verl(mask, group_ids) & (alpha_verl == alpha_jppo)  # equal ratios round identically


@dataclasses.dataclass(frozen=True)
class GoldenEntry:
    key: str  # golden key after "caseN/"
    estimator: str
    output: int  # 0: advantages, 1: returns
    options: tuple = ()
    scalars: tuple = ()  # traced scalar inputs, e.g. (("gamma", 0.99),)
    rows: str = "all"  # which rows verl's rules and jppo's agree on, see the *_rows_as_verl helpers

    def __str__(self) -> str:
        return self.key


def _golden_entries() -> list[GoldenEntry]:
    entries = []
    for gamma in ("1.0", "0.99"):
        for lam in ("0.95", "1.0"):
            for output, name in enumerate(("advantages", "returns")):
                scalars = (("gamma", float(gamma)), ("lam", float(lam)))
                entries.append(GoldenEntry(f"gae/gamma{gamma}_lam{lam}/{name}", "gae", output, scalars=scalars))
        for output, name in enumerate(("advantages", "returns")):
            entries.append(
                GoldenEntry(
                    f"reinforce_plus_plus/gamma{gamma}/{name}",
                    "reinforce_plus_plus",
                    output,
                    scalars=(("gamma", float(gamma)),),
                )
            )
    entries += [GoldenEntry("remax/advantages", "remax", 0), GoldenEntry("remax/returns", "remax", 1)]
    for norm in (True, False):
        options = (("norm_by_std", norm),)
        entries.append(GoldenEntry(f"grpo/norm{norm}/advantages", "grpo", 0, options, rows="group"))
        entries.append(GoldenEntry(f"grpo_passk/norm{norm}/advantages", "grpo_passk", 0, options, rows="group"))
    entries += [
        GoldenEntry("rloo/advantages", "rloo", 0, rows="group"),
        GoldenEntry("rloo_vectorized/advantages", "rloo", 0, rows="group_or_singleton"),
        GoldenEntry("opo/advantages", "opo", 0, rows="group"),
        GoldenEntry("gpg/advantages", "gpg", 0, rows="gpg"),
    ]
    return entries


def rows_as_verl(entry: GoldenEntry, arrays: dict[str, np.ndarray]) -> np.ndarray:
    mask, rewards = arrays["mask"], arrays["token_level_rewards"]
    if entry.rows == "all":
        return np.ones(len(mask), dtype=bool)
    if entry.rows == "gpg":
        return gpg_rows_as_verl(mask, arrays["group_ids"], rewards)
    return group_rows_as_verl(mask, arrays["group_ids"], singletons_agree=entry.rows == "group_or_singleton")


def assert_matches_verl(actual: np.ndarray, expected: np.ndarray, mask: np.ndarray, rows: np.ndarray) -> None:
    """The one comparison with verl: valid positions of the selected rows (verl leaves values at masked ones)."""
    compared = (mask > 0) & rows[:, None]
    assert compared.any(), "nothing left to compare"
    np.testing.assert_allclose(actual[compared], expected[compared], rtol=VERL_RTOL, atol=VERL_ATOL)


@pytest.mark.parametrize("entry", _golden_entries(), ids=str)
@pytest.mark.parametrize("case", CASES)
def test_estimator_matches_verl(case: str, entry: GoldenEntry) -> None:
    arrays = estimator_arrays(entry.estimator, golden_inputs(case))
    traced = {**arrays, **{name: np.float64(value) for name, value in entry.scalars}}
    outputs = run_jitted(entry.estimator, traced, entry.options)
    actual = np.asarray(outputs[entry.output])
    assert_matches_verl(actual, load_golden()[f"{case}/{entry.key}"], arrays["mask"], rows_as_verl(entry, arrays))
    assert np.all(actual[arrays["mask"] == 0] == 0), "masked positions must hold 0"
    if "group_ids" in arrays:  # where verl gives a group of one its raw score, jppo's rule gives 0
        same = arrays["group_ids"][:, None] == arrays["group_ids"][None, :]
        alone = (same & (arrays["mask"].sum(axis=1) > 0)[None, :]).sum(axis=1) == 1
        assert np.all(actual[alone] == 0)


@pytest.mark.parametrize("case", CASES)
def test_reinforce_plus_plus_baseline_matches_verl(case: str) -> None:
    """Whitening couples all rows, so a group verl treats differently moves the batch mean and std. On the rows
    where the rules agree, both whiten the same centered scores, so jppo's values are a positive affine image
    of verl's (exactly verl's when every row agrees, as in case1)."""
    arrays = estimator_arrays("reinforce_plus_plus_baseline", golden_inputs(case))
    actual = np.asarray(run_jitted("reinforce_plus_plus_baseline", arrays)[0])
    expected = load_golden()[f"{case}/reinforce_plus_plus_baseline/advantages"]
    rows = group_rows_as_verl(arrays["mask"], arrays["group_ids"])
    if rows.all():
        assert_matches_verl(actual, expected, arrays["mask"], rows)
        return
    compared = (arrays["mask"] > 0) & rows[:, None]
    design = np.stack([expected[compared], np.ones(compared.sum())], axis=1)
    (scale, shift), *_ = np.linalg.lstsq(design, actual[compared], rcond=None)
    assert scale > 0
    np.testing.assert_allclose(actual[compared], scale * expected[compared] + shift, rtol=VERL_RTOL, atol=VERL_ATOL)


@pytest.mark.parametrize("case", CASES)
def test_masked_statistics_match_verl(case: str) -> None:
    golden, inputs = load_golden(), golden_inputs(case)
    x, mask = inputs["advantages"], inputs["response_mask"]
    everywhere = np.ones(len(mask), dtype=bool)
    np.testing.assert_allclose(masked_mean(x, mask), golden[f"{case}/masked/mean"], rtol=VERL_RTOL)
    np.testing.assert_allclose(masked_var(x, mask), golden[f"{case}/masked/var_unbiased"], rtol=VERL_RTOL)
    assert_matches_verl(np.asarray(masked_whiten(x, mask)), golden[f"{case}/masked/whiten"], mask, everywhere)
    noshift = np.asarray(masked_whiten(x, mask, shift_mean=False))
    assert_matches_verl(noshift, golden[f"{case}/masked/whiten_noshift"], mask, everywhere)


# ------------------------------------------------------------------------------------------------ jppo's rules


def hand_batch() -> dict[str, np.ndarray]:
    """Six rows, L = 4: group 7 = rows 0, 1 (+ empty row 5), group -3 = rows 2, 3 (tied), group 2**40 = row 4.

    Scores under the mask: row 0: 0.25 + 0.75 = 1 over 2 tokens; row 1: 0 over 4 tokens; rows 2, 3: 0.5 over 3 and
    1 token; row 4: 0.7 over 3 tokens (3 * 0.7 / 3 != 0.7 in float64, so a length-weighted mean of one row is not
    exactly its score). Row 5 has no valid token but a reward of 5 at a masked position, where verl
    reward managers put an empty response's score; rows 1 and 4 hold garbage at masked positions too.
    """
    mask = np.array(
        [[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0], [0, 1, 0, 0], [1, 0, 1, 1], [0, 0, 0, 0]], dtype=np.float64
    )
    rewards = np.array(
        [
            [0.25, 0.75, 0.0, 0.0],
            [0.0, 0.0, 0.0, 0.0],
            [0.0, 0.0, 0.5, 0.0],
            [0.0, 0.5, 0.0, 0.0],
            [0.0, 9.0, 0.7, 0.0],
            [0.0, 0.0, 0.0, 5.0],
        ]
    )
    return {"token_level_rewards": rewards, "mask": mask, "group_ids": np.array([7, 7, -3, -3, 2**40, 7])}


def _hand_expected_rows() -> dict[str, np.ndarray]:
    """Per-row advantages of :func:`hand_batch`, worked out by hand. Group 7 is rows 0 and 1 only (the empty row
    belongs to no group): mean 1/2, unbiased std sqrt(1/2). Tied group -3 and the group of one get 0."""
    std_7 = np.sqrt(0.5) + 1e-6
    opo_baseline = (2 * 1.0 + 4 * 0.0) / (2 + 4)  # length-weighted mean of group 7
    gpg_alpha = 5 / 4  # 5 non-empty rows, 4 of them (0, 2, 3, 4) with a non-zero score
    return {
        "grpo": np.array([0.5 / std_7, -0.5 / std_7, 0, 0, 0, 0]),
        "dr_grpo": np.array([0.5, -0.5, 0, 0, 0, 0]),
        "rloo": np.array([1.0, -1.0, 0, 0, 0, 0]),
        "opo": np.array([1 - opo_baseline, -opo_baseline, 0, 0, 0, 0]),
        "gpg": np.array([gpg_alpha * 0.5, -gpg_alpha * 0.5, 0, 0, 0, 0]),
        "grpo_passk": np.array([1.0 / std_7, 0, 0, 0, 0, 0]),  # row 0 beats row 1 by 1; ties and singletons: 0
    }


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "opo", "gpg", "grpo_passk"])
def test_group_rules_on_a_hand_worked_batch(name: str) -> None:
    """Masked score sums, empty rows outside every group, 0 for a tied group and a group of one, any int ids."""
    batch = hand_batch()
    estimator, options = ("grpo", (("norm_by_std", False),)) if name == "dr_grpo" else (name, ())
    advantages, returns = run_jitted(estimator, batch, options)
    expected = np.where(batch["mask"] > 0, _hand_expected_rows()[name][:, None], 0)
    np.testing.assert_allclose(advantages, expected, rtol=REORDER_RTOL, atol=0)  # the rule's zeros are exact
    np.testing.assert_array_equal(returns, advantages)


def test_reinforce_plus_plus_baseline_whitens_a_group_of_one_like_a_tied_group() -> None:
    batch = hand_batch()
    advantages = np.asarray(run_jitted("reinforce_plus_plus_baseline", batch)[0])
    # Centered scores on the 13 valid tokens: +1/2 on row 0's 2 tokens, -1/2 on row 1's 4, 0 on the other 7.
    centered = np.array([0.5] * 2 + [-0.5] * 4 + [0.0] * 7)
    mean, std = centered.mean(), centered.std(ddof=1)
    tied_value = (0 - mean) / np.sqrt(std**2 + 1e-8)
    np.testing.assert_allclose(advantages[0, :2], (0.5 - mean) / np.sqrt(std**2 + 1e-8), rtol=REORDER_RTOL)
    np.testing.assert_allclose(advantages[2:5][batch["mask"][2:5] > 0], tied_value, rtol=REORDER_RTOL)
    assert np.all(advantages[batch["mask"] == 0] == 0)


@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
def test_empty_row_belongs_to_no_group(name: str) -> None:
    """case2's row 3 is empty but carries a score at a masked position: moving it to any other group (here a
    group of its own) changes nothing, so it neither shifts nor enlarges the group it was sampled in."""
    arrays = estimator_arrays(name, golden_inputs("case2"))
    moved = dict(arrays, group_ids=np.where(np.arange(8) == 3, 12345, arrays["group_ids"]))
    assert arrays["mask"][3].sum() == 0 and arrays["token_level_rewards"][3].sum() != 0
    original, after_move = run_jitted(name, arrays), run_jitted(name, moved)
    np.testing.assert_array_equal(original[0], after_move[0])
    assert np.all(np.asarray(original[0])[3] == 0)


@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
def test_group_ids_are_arbitrary_and_rows_permute(name: str) -> None:
    """Relabelling the groups with large / negative ids and shuffling the rows shuffles the result the same way."""
    rng = np.random.default_rng(0)
    for case in ("case0", "case3"):
        arrays = estimator_arrays(name, golden_inputs(case))
        relabel = np.array([-(2**62), 2**45 + 3, -1])
        permutation = rng.permutation(8)
        shuffled = {key: value[permutation] for key, value in arrays.items()}
        shuffled["group_ids"] = relabel[shuffled["group_ids"]]
        original, permuted = run_jitted(name, arrays), run_jitted(name, shuffled)
        # atol: reordered float64 sums leave ~1e-16 where a value is 0 (tied groups, whitened means).
        np.testing.assert_allclose(permuted[0], np.asarray(original[0])[permutation], rtol=REORDER_RTOL, atol=1e-15)


@functools.partial(jax.jit, static_argnames=("name",))
def outputs_and_gradients(name: str, arrays: dict, cotangents: tuple) -> tuple:
    """Both outputs and the gradient of a fixed linear function of them w.r.t. every float input array."""
    floats = {key: value for key, value in arrays.items() if key not in ("mask", "group_ids")}
    rest = {key: value for key, value in arrays.items() if key in ("mask", "group_ids")}
    outputs, pullback = jax.vjp(lambda f: run_estimator(name, **f, **rest), floats)
    return outputs, pullback(cotangents)[0]


def plant(arrays: dict[str, np.ndarray], fill: float) -> dict[str, np.ndarray]:
    """``fill`` at every masked position of the token arrays and as the baseline of rows without valid tokens."""
    mask = arrays["mask"] > 0
    planted = dict(arrays)
    for key in ("token_level_rewards", "values"):
        if key in arrays:
            planted[key] = np.where(mask, arrays[key], fill)
    if "reward_baselines" in arrays:
        planted["reward_baselines"] = np.where(mask.any(axis=1), arrays["reward_baselines"], fill)
    return planted


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_masked_inputs_reach_neither_outputs_nor_gradients(name: str) -> None:
    """NaN, Inf or a huge finite value at masked positions (and in the baseline of an empty row) leave outputs and
    gradients exactly as with clean inputs, so whitening and group statistics see valid tokens only. case1 has
    tied groups (zero std), case2 an empty row, case3 holes inside responses."""
    gamma_lam = {"gamma": np.float64(0.99), "lam": np.float64(0.95)}
    accepted = ADVANTAGE_ESTIMATORS[name].parameters
    rng = np.random.default_rng(1)
    cotangents = (rng.normal(size=(8, 16)), rng.normal(size=(8, 16)))
    for case in ("case1", "case2", "case3"):
        arrays = estimator_arrays(name, golden_inputs(case))
        arrays.update({key: value for key, value in gamma_lam.items() if key in accepted})
        clean_outputs, clean_grads = outputs_and_gradients(name, arrays, cotangents)
        assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves((clean_outputs, clean_grads)))
        for fill in (np.nan, np.inf, -1e6):
            outputs, grads = outputs_and_gradients(name, plant(arrays, fill), cotangents)
            for got, want in zip(jax.tree.leaves((outputs, grads)), jax.tree.leaves((clean_outputs, clean_grads))):
                np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name", ["gae", "reinforce_plus_plus_baseline", "gpg"])
def test_rows_sharded_over_devices_give_the_whole_batch_result(name: str) -> None:
    """Under jit with row-sharded global arrays, whitening, group statistics and GPG's alpha stay batch-wide: the
    case0 groups span shards (one row per device)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    arrays = estimator_arrays(name, golden_inputs("case0"))
    traced = dict(arrays, gamma=np.float64(0.99), lam=np.float64(0.95)) if name == "gae" else arrays
    sharded = {key: jax.device_put(value, rows) if np.ndim(value) else value for key, value in traced.items()}
    whole, split = run_jitted(name, traced), run_jitted(name, sharded)
    for got, want in zip(split, whole):
        np.testing.assert_allclose(got, want, rtol=REORDER_RTOL, atol=1e-15)  # atol: as in the permutation test


# ------------------------------------------------------------------------------------------------------- scale


def large_batch(rows: int = 16384, length: int = 4, size: int = 8) -> dict[str, np.ndarray]:
    """A trainer-sized float32 batch: shuffled groups of ``size`` under random int32 ids, holes in the masks, some
    empty rows (which leave their group smaller) and some rows moved to a group of their own."""
    rng = np.random.default_rng(16)
    ids = rng.choice(2**31 - 1, size=rows // size + rows, replace=False).astype(np.int32) - 2**30
    group_ids = np.repeat(ids[: rows // size], size)[rng.permutation(rows)]
    alone = rng.random(rows) < 0.01
    group_ids[alone] = ids[rows // size :][alone]
    mask = rng.random((rows, length)) < 0.8
    mask[rng.random(rows) < 0.01] = False
    rewards = rng.normal(size=(rows, length)).astype(np.float32)
    return {"token_level_rewards": rewards, "mask": mask.astype(np.float32), "group_ids": group_ids}


def grouped_reference(batch: dict[str, np.ndarray], epsilon: float = 1e-6) -> dict[str, np.ndarray]:
    """Per-row GRPO, RLOO and pass@k advantages in float64, the groups gathered in a dict keyed by id."""
    valid = batch["mask"] > 0
    scores = np.where(valid, batch["token_level_rewards"].astype(np.float64), 0).sum(axis=1)
    members: dict[int, list[int]] = {}
    for row, group_id in enumerate(batch["group_ids"]):
        if valid[row].any():
            members.setdefault(int(group_id), []).append(row)
    rows = {name: np.zeros(len(scores)) for name in ("grpo", "rloo", "grpo_passk")}
    for group in members.values():
        if len(group) < 2:
            continue
        s, k = scores[group], len(group)
        std = s.std(ddof=1) + epsilon
        rows["grpo"][group] = (s - s.mean()) / std
        rows["rloo"][group] = s - (s.sum() - s) / (k - 1)
        runner_up, best = np.sort(s)[-2:]
        rows["grpo_passk"][group] = np.where(s == best, best - runner_up, 0) / std
    return {name: np.where(valid, value[:, None], 0) for name, value in rows.items()}


@pytest.mark.parametrize("name", ["grpo", "rloo", "grpo_passk"])
def test_group_statistics_of_16k_rows_need_no_quadratic_memory(name: str) -> None:
    """16384 rows in groups of 8, float32 as the trainer runs them: XLA's temporaries stay under 64 MiB (a
    ``[B, B]`` bool is 256 MiB, a float32 one 1 GiB), the result matches a float64 reference over a dict of
    groups, and row-sharded over 8 devices it is the same.

    Tolerance (float32 against float64): advantages reach |A| ~ 8 and the largest error seen is 1e-6 absolute
    (a few float32 ulps of a sum of 8 scores), so atol 1e-5 with rtol 1e-5; the atol covers values near 0, whose
    relative error is larger. Sharded, the same float32 program may fuse differently: 1e-6.
    """
    with jax.enable_x64(False):
        batch = large_batch()
        estimator = jax.jit(lambda arrays: run_estimator(name, **arrays)[0])
        compiled = estimator.lower(batch).compile()
        temp_bytes = compiled.memory_analysis().temp_size_in_bytes
        assert temp_bytes < 64 * 2**20, f"{temp_bytes / 2**20:.1f} MiB of temporaries"
        advantages = np.asarray(compiled(batch))
        expected = grouped_reference(batch)[name]
        assert np.any(expected != 0) and advantages.dtype == np.float32
        np.testing.assert_allclose(advantages, expected, rtol=1e-5, atol=1e-5)
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
        rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
        sharded = np.asarray(estimator({key: jax.device_put(value, rows) for key, value in batch.items()}))
        np.testing.assert_allclose(sharded, advantages, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------------- registry


def test_registry_records_what_each_estimator_needs() -> None:
    needs = {
        name: (e.needs_critic, e.needs_group_ids, e.needs_reward_baselines) for name, e in ADVANTAGE_ESTIMATORS.items()
    }
    assert needs == {
        "gae": (True, False, False),
        "reinforce_plus_plus": (False, False, False),
        "remax": (False, False, True),
        **{name: (False, True, False) for name in GROUP_ESTIMATORS},
    }
    assert ADVANTAGE_ESTIMATORS["gae"].required == ("token_level_rewards", "values", "mask", "gamma", "lam")


def test_unknown_estimator_and_bad_inputs_raise_clear_errors() -> None:
    batch = hand_batch()
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'ppo'.*gae.*grpo.*rloo"):
        run_estimator("ppo", **batch)
    with pytest.raises(ValueError, match=r"'gae' is missing input\(s\) values, gamma, lam"):
        run_estimator("gae", token_level_rewards=batch["token_level_rewards"], mask=batch["mask"])
    with pytest.raises(ValueError, match=r"'grpo' does not take gamma; it takes token_level_rewards"):
        run_estimator("grpo", gamma=1.0, **batch)
    with pytest.raises(ValueError, match=r"group_ids must be \[batch\] = \(6,\); got \(5,\)"):
        run_estimator("rloo", **dict(batch, group_ids=batch["group_ids"][:5]))
    with pytest.raises(ValueError, match=r"values must have the mask's shape \(6, 4\); got \(6, 3\)"):
        run_estimator(
            "gae",
            token_level_rewards=batch["token_level_rewards"],
            values=batch["mask"][:, :3],
            mask=batch["mask"],
            gamma=1.0,
            lam=1.0,
        )
