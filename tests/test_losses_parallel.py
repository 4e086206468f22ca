"""Data parallelism and gradient accumulation keep the whole-mini-batch loss, gradient and metrics.

A tiny model with replicated parameters (a linear map to logits of the sampled token, and a linear value head)
is trained on a ragged batch (empty and single-token rows, NaN in the data at masked positions):

- inside ``jax.shard_map`` over 1, 2, 4, 8 CPU devices, with ``global_norm_stats(..., axis_name="data")``, the psum
  of the shards' shares is the single-device loss, ``jax.grad`` of the shard_map'ed loss (``check_vma=True``) is
  the whole-batch gradient, and psum-ed metrics finish to the whole-batch values;
- ``optax.MultiSteps(..., use_grad_mean=False)`` fed the micro-batch gradients of the shares makes exactly the step
  of the whole batch; the optax default (mean) makes a 1/K step;
- the legacy per-micro-batch normalization (each piece passes its own counts) inflates the token-mean gradient by K.

All in float64: the shards and micro-batches sum the same terms in another order, so results agree to a few ulps
(rtol 1e-10; atol 1e-12 for entries that are 0 in one computation and ~1e-17 in the other).
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jppo.core import metrics as metrics_lib
from jppo.core.masked import global_norm_stats
from jppo.losses import AGG_MODES, PolicyLossOptions, actor_loss, value_loss

ROWS, LENGTH, FEATURES = 8, 5, 3
LOSS_SCALE_FACTOR = 7.0
RTOL, ATOL = 1e-10, 1e-12
OPTIONS = PolicyLossOptions(clip_ratio_high=0.28, clip_ratio_c=1.5)


def make_batch(seed: int = 0, lengths: tuple[int, ...] = (0, 1, 5, 3, 4, 2, 5, 1)) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    mask = np.arange(LENGTH) < np.asarray(lengths)[:, None]
    data = {
        "old_log_prob": -rng.exponential(0.7, (ROWS, LENGTH)),
        "ref_log_prob": -rng.exponential(0.7, (ROWS, LENGTH)),
        "advantages": rng.normal(size=(ROWS, LENGTH)),
        "values": rng.normal(size=(ROWS, LENGTH)),
        "returns": rng.normal(size=(ROWS, LENGTH)),
    }
    batch = {name: np.where(mask, array, np.nan) for name, array in data.items()}
    batch["features"] = rng.normal(size=(ROWS, LENGTH, FEATURES))  # model input: finite everywhere
    batch["entropy"] = np.where(mask, rng.uniform(0, 2, (ROWS, LENGTH)), np.inf)
    batch["mask"] = mask.astype(np.float64)
    return batch


def init_params(seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"policy": rng.normal(size=FEATURES), "bias": np.asarray(0.3), "value": rng.normal(size=FEATURES)}


def objective(params, batch, norm, mode):
    """Actor (vanilla PPO + entropy bonus + k3 KL) plus critic share of one piece of the batch."""
    log_prob = jax.nn.log_sigmoid(batch["features"] @ params["policy"] + params["bias"])
    vpreds = batch["features"] @ params["value"]
    actor_share, actor_metrics = actor_loss(
        log_prob, batch["old_log_prob"], batch["advantages"], batch["mask"], norm=norm, mode=mode,
        policy_loss_name="vanilla", policy_options=OPTIONS, entropy=batch["entropy"], entropy_coeff=0.01,
        ref_log_prob=batch["ref_log_prob"], kl_loss_coef=0.1, kl_loss_type="low_var_kl",
    )
    critic_share, critic_metrics = value_loss(
        vpreds, batch["values"], batch["returns"], batch["mask"], cliprange_value=0.2, mode=mode, norm=norm
    )
    return actor_share + critic_share, actor_metrics | critic_metrics


@jax.jit
def whole_batch(params, batch):
    norm = global_norm_stats(batch["mask"], LOSS_SCALE_FACTOR)
    return {
        mode: jax.value_and_grad(objective, has_aux=True)(params, batch, norm, mode) for mode in AGG_MODES
    }


@functools.cache
def sharded(num_devices: int):
    """Every mode's (psum of shares, psum-ed metrics) and its gradient w.r.t. the replicated parameters, on a
    ``data`` mesh of the first ``num_devices`` devices (Auto axes: inputs are resharded for us)."""
    mesh = Mesh(np.array(jax.devices()[:num_devices]), ("data",))

    def loss(params, batch, mode):
        def per_shard(params, batch):
            norm = global_norm_stats(batch["mask"], LOSS_SCALE_FACTOR, axis_name="data")
            share, metrics = objective(params, batch, norm, mode)
            return jax.lax.psum(share, "data"), metrics_lib.psum(metrics, "data")

        return jax.shard_map(
            per_shard, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(), check_vma=True
        )(params, batch)

    @jax.jit
    def run(params, batch):
        return {mode: jax.value_and_grad(loss, has_aux=True)(params, batch, mode) for mode in AGG_MODES}

    return run


def _close(actual, expected, what: str) -> None:
    try:
        chex.assert_trees_all_close(actual, expected, rtol=RTOL, atol=ATOL)
    except AssertionError as error:
        raise AssertionError(f"{what}: {error}") from None


@pytest.mark.parametrize("num_devices", [1, 2, 4, 8])
def test_shard_map_matches_single_device(num_devices):
    with jax.enable_x64(True):
        params, batch = init_params(), make_batch()
        expected = whole_batch(params, batch)
        actual = sharded(num_devices)(params, batch)
        for mode in AGG_MODES:
            (share, metrics), grad = actual[mode]
            (whole_share, whole_metrics), whole_grad = expected[mode]
            finite = all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(grad))
            assert finite, f"{mode}: NaN from the padding reached the gradient"
            _close(share, whole_share, f"{mode} loss on {num_devices} devices")
            _close(grad, whole_grad, f"{mode} gradient on {num_devices} devices")
            _close(metrics_lib.finish(metrics), metrics_lib.finish(whole_metrics), f"{mode} metrics")


@pytest.mark.parametrize("num_devices", [2, 8])
def test_psum_of_the_shard_map_gradient_double_counts(num_devices):
    """check_vma already sums a replicated parameter's gradient over the axis; an extra all-reduce (the reflex from
    torch DDP) multiplies it by the axis size. Do not add one."""
    mesh = Mesh(np.array(jax.devices()[:num_devices]), ("data",))
    with jax.enable_x64(True):
        params, batch = init_params(), make_batch()
        (_, _), grad = sharded(num_devices)(params, batch)["token-mean"]
        all_reduced = jax.shard_map(
            lambda g: jax.lax.psum(g, "data"), mesh=mesh, in_specs=P(), out_specs=P(), check_vma=True
        )(grad)
        (_, _), whole_grad = whole_batch(params, batch)["token-mean"]
        _close(grad, whole_grad, "shard_map gradient")
        _close(all_reduced, jax.tree.map(lambda g: num_devices * g, whole_grad), "psum-ed again")


@jax.jit
def _piece_grad(params, piece, norm):
    return jax.grad(lambda p: objective(p, piece, norm, "token-mean")[0])(params)


def _pieces(batch, cuts):
    return [{name: array[rows] for name, array in batch.items()} for rows in np.split(np.arange(ROWS), cuts)]


def _accumulate(optimizer, params, grads):
    state = optimizer.init(params)
    for grad in grads:
        updates, state = optimizer.update(grad, state, params)
        params = optax.apply_updates(params, updates)
    return params


# uneven micro-batches of 1, 4 and 3 rows; the first holds only the empty row
MICRO_BATCH_CUTS = [1, 5]


@pytest.mark.parametrize("name", ["sgd", "adamw+clip"])
def test_multisteps_sum_equals_one_whole_batch_step(name):
    clip = 1e-3
    inner = optax.sgd(0.1) if name == "sgd" else optax.chain(
        optax.clip_by_global_norm(clip), optax.adamw(1e-2, weight_decay=0.1)
    )
    k = len(MICRO_BATCH_CUTS) + 1
    with jax.enable_x64(True):
        params, batch = init_params(), make_batch()
        norm = global_norm_stats(jnp.asarray(batch["mask"]), LOSS_SCALE_FACTOR)  # once, before the cut
        whole_grad = _piece_grad(params, batch, norm)
        if name != "sgd":
            assert optax.global_norm(whole_grad) > clip, "clipping must be active for this test to mean anything"
        expected = _accumulate(inner, params, [whole_grad])
        micro_grads = [_piece_grad(params, piece, norm) for piece in _pieces(batch, MICRO_BATCH_CUTS)]
        # accumulator_dtype: MultiSteps accumulates in float32 unless told otherwise
        summing = optax.MultiSteps(inner, every_k_schedule=k, use_grad_mean=False, accumulator_dtype=jnp.float64)
        _close(_accumulate(summing, params, micro_grads), expected, f"{name}: K={k} summed micro-batch steps")


def test_multisteps_default_mean_takes_a_one_over_k_step():
    """Pinned: the optax default averages the K gradients, i.e. a 1/K-sized SGD step. jppo's shares need the sum."""
    k = len(MICRO_BATCH_CUTS) + 1
    with jax.enable_x64(True):
        params, batch = init_params(), make_batch()
        norm = global_norm_stats(jnp.asarray(batch["mask"]), LOSS_SCALE_FACTOR)
        micro_grads = [_piece_grad(params, piece, norm) for piece in _pieces(batch, MICRO_BATCH_CUTS)]
        whole_step = jax.tree.map(lambda g: -0.1 * g, _piece_grad(params, batch, norm))
        averaging = optax.MultiSteps(optax.sgd(0.1), every_k_schedule=k, accumulator_dtype=jnp.float64)
        moved = jax.tree.map(jnp.subtract, _accumulate(averaging, params, micro_grads), params)
        _close(moved, jax.tree.map(lambda s: s / k, whole_step), "default use_grad_mean=True step")


@jax.jit
def _legacy_piece_grad(params, piece):
    own = global_norm_stats(piece["mask"], LOSS_SCALE_FACTOR)  # the legacy mode: the piece's own counts
    return jax.grad(lambda p: objective(p, piece, own, "token-mean")[0])(params)


def test_legacy_local_normalization_inflates_token_mean_gradient_by_k():
    """Pinned on purpose (legacy mode, CONTRACT section 6): K equal micro-batches with equal token counts, each
    normalized by its own tokens, give K times the whole-batch token-mean gradient. This is the bug the contract
    exists to prevent; the legacy mode reproduces it only to compare with published curves. Do not "fix" it here."""
    k = 4
    with jax.enable_x64(True):
        params = init_params()
        batch = make_batch(lengths=(2, 3, 4, 1, 5, 0, 3, 2))  # every pair of rows holds 5 tokens
        norm = global_norm_stats(jnp.asarray(batch["mask"]), LOSS_SCALE_FACTOR)
        whole_grad = _piece_grad(params, batch, norm)
        pieces = _pieces(batch, [2, 4, 6])
        assert len(pieces) == k and len({float(piece["mask"].sum()) for piece in pieces}) == 1
        legacy = jax.tree.map(lambda *g: sum(g), *[_legacy_piece_grad(params, piece) for piece in pieces])
        _close(legacy, jax.tree.map(lambda g: k * g, whole_grad), "legacy per-micro-batch gradient")
