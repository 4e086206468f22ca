"""Bad input fails at trace time with one clear line naming the offending name/value and the valid choices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jppo.core.masked import global_norm_stats
from jppo.losses import (
    PolicyLossOptions,
    actor_loss,
    agg_loss,
    entropy_from_logits,
    entropy_loss,
    kl_loss,
    kl_penalty,
    penalize_rewards,
    policy_loss,
    register_policy_loss,
    value_loss,
)
from jppo.rewards.kl_penalty import AdaptiveKLController

B, T = 2, 3
X = jnp.zeros((B, T))
MASK = jnp.ones((B, T))
NORM = global_norm_stats(MASK)


def _actor(**overrides):
    arguments = dict(norm=NORM, mode="token-mean", policy_loss_name="vanilla", policy_options=PolicyLossOptions())
    return actor_loss(X, X, X, MASK, **(arguments | overrides))


BAD_MODE = {
    "agg_loss": lambda: agg_loss(X, MASK, "token_mean", NORM),
    "policy_loss": lambda: policy_loss("vanilla", X, X, X, MASK, mode="token_mean", norm=NORM),
    "value_loss": lambda: value_loss(X, X, X, MASK, cliprange_value=0.2, mode="token_mean", norm=NORM),
    "entropy_loss": lambda: entropy_loss(X, MASK, mode="token_mean", norm=NORM),
    "kl_loss": lambda: kl_loss(X, X, MASK, kind="k3", mode="token_mean", norm=NORM),
    "actor_loss": lambda: _actor(mode="token_mean"),
    "jitted": lambda: jax.jit(lambda x: policy_loss("gspo", x, x, x, MASK, mode="token_mean", norm=NORM))(X),
}


@pytest.mark.parametrize("call", sorted(BAD_MODE))
def test_unknown_mode(call):
    with pytest.raises(ValueError, match=r"'token_mean'.*seq-mean-token-sum-norm"):
        BAD_MODE[call]()


@pytest.mark.parametrize("call", ["policy_loss", "actor_loss"])
def test_unknown_policy_loss(call):
    run = {
        "policy_loss": lambda: policy_loss("clip_cov", X, X, X, MASK, mode="token-mean", norm=NORM),
        "actor_loss": lambda: _actor(policy_loss_name="clip_cov"),
    }[call]
    with pytest.raises(ValueError, match=r"'clip_cov'.*geo_mean.*vanilla"):
        run()


@pytest.mark.parametrize("name, mode", [("gspo", "token-mean"), ("geo_mean", "seq-mean-token-sum")])
def test_sequence_level_loss_needs_its_mode(name, mode):
    def share(log_prob, agg_mode):
        options = PolicyLossOptions()
        return actor_loss(log_prob, X, X, MASK, norm=NORM, mode=agg_mode, policy_loss_name=name,
                          policy_options=options)[0]

    message = rf"^policy loss '{name}' needs mode='seq-mean-token-mean' .*got mode='{mode}'"
    with pytest.raises(ValueError, match=message) as error:
        share(X, mode)
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match=message):  # raised in Python at trace time, so under jit too
        jax.jit(share, static_argnums=1)(X, mode)
    assert jnp.isfinite(share(X, "seq-mean-token-mean"))


BAD_KL = {
    "kl_penalty": lambda: kl_penalty(X, X, "k4"),
    "kl_loss": lambda: kl_loss(X, X, MASK, kind="k4", mode="token-mean", norm=NORM),
    "penalize_rewards": lambda: penalize_rewards(X, X, X, MASK, kl_coef=0.1, kind="k4"),
    "actor_loss": lambda: _actor(ref_log_prob=X, kl_loss_coef=0.1, kl_loss_type="k4"),
}


@pytest.mark.parametrize("call", sorted(BAD_KL))
def test_unknown_kl_kind(call):
    with pytest.raises(ValueError, match=r"'k4'.*low_var_kl"):
        BAD_KL[call]()


def test_unknown_option_name():
    with pytest.raises(ValueError, match=r"clip_ratio_hi\b.*clip_ratio_high"):
        policy_loss("vanilla", X, X, X, MASK, mode="token-mean", norm=NORM, clip_ratio_hi=0.28)


@pytest.mark.parametrize(
    "name, options, bad",
    [
        ("vanilla", dict(clip_ratio_c=0.9), "clip_ratio_c=0.9"),
        ("dro", dict(), "dro_beta=None"),
        ("dro", dict(dro_beta=-1.0), "dro_beta=-1.0"),
        ("sapo", dict(tau_neg=0.0), "tau_neg=0.0"),
        ("vanilla", dict(clip_ratio_high=-0.2), "clip_ratio_high=-0.2"),
        ("geo_mean", dict(clip_ratio=-1.0), "clip_ratio=-1.0"),
        ("dppo_tv", dict(clip_ratio_c=0.0), "clip_ratio_c=0.0"),
    ],
)
def test_invalid_option_value(name, options, bad):
    with pytest.raises(ValueError, match=bad):
        policy_loss(name, X, X, X, MASK, mode="token-mean", norm=NORM, **options)


SHAPE_MISMATCH = {
    "log_prob": lambda: policy_loss("vanilla", jnp.zeros((B, T + 1)), X, X, MASK, mode="token-mean", norm=NORM),
    "advantages": lambda: policy_loss("vanilla", X, X, jnp.zeros((B, 1)), MASK, mode="token-mean", norm=NORM),
    "returns": lambda: value_loss(
        X, X, jnp.zeros((B + 1, T)), MASK, cliprange_value=0.2, mode="token-mean", norm=NORM
    ),
    "ref_log_prob": lambda: kl_loss(X, jnp.zeros(T), MASK, kind="kl", mode="token-mean", norm=NORM),
    "entropy": lambda: entropy_loss(jnp.zeros((B, T, 1)), MASK, mode="token-mean", norm=NORM),
    "token_level_scores": lambda: penalize_rewards(jnp.zeros((B, T + 2)), X, X, MASK, kl_coef=0.1),
    "mask": lambda: policy_loss("vanilla", X, X, X, jnp.ones(T), mode="token-mean", norm=NORM),
    "logits": lambda: entropy_from_logits(jnp.zeros((B, T, 5)), jnp.ones((B, T + 1))),
    "loss_mat": lambda: agg_loss(X, jnp.ones((B, T + 1)), "token-mean", NORM),
}


@pytest.mark.parametrize("name", sorted(SHAPE_MISMATCH))
def test_shape_mismatch_names_the_input(name):
    with pytest.raises(ValueError, match=name):
        SHAPE_MISMATCH[name]()


@pytest.mark.parametrize(
    "overrides, bad",
    [(dict(entropy_coeff=0.01), "entropy_coeff=0.01"), (dict(kl_loss_coef=0.1), "kl_loss_coef=0.1")],
)
def test_actor_coefficient_without_its_input(overrides, bad):
    with pytest.raises(ValueError, match=bad):
        _actor(**overrides)


@pytest.mark.parametrize("arguments, bad", [(dict(horizon=0), "horizon=0"), (dict(target_kl=0.0), "target_kl=0.0")])
def test_adaptive_kl_controller_rejects_bad_configuration(arguments, bad):
    with pytest.raises(ValueError, match=bad):
        AdaptiveKLController(**(dict(init_kl_coef=0.1, target_kl=6.0, horizon=10000) | arguments))


def test_registering_a_name_twice_is_refused():
    with pytest.raises(ValueError, match="'vanilla' is already registered"):
        register_policy_loss("vanilla")(lambda *args: None)


def test_token_sum_norm_needs_the_configured_constant():
    """C comes only from the caller's NormStats: no loss term has a default normalizer to fall back on."""
    mask = jnp.ones((2, 3))
    with pytest.raises(TypeError, match="norm"):
        agg_loss(jnp.ones((2, 3)), mask, "seq-mean-token-sum-norm")


def test_the_actor_loss_refuses_its_options_before_tracing():
    """The engine checks the variant's options when it builds the loss, with the rules the config also runs."""
    from jppo.core.errors import InvalidSetting
    from jppo.engine import ActorConfig, actor_loss_fn
    from jppo.losses import OPTION_RULES, check_policy_options

    assert {rule.option for rule in OPTION_RULES["vanilla"]} >= {"clip_ratio", "clip_ratio_c"}
    with pytest.raises(InvalidSetting,
                       match=r"policy loss 'vanilla' option clip_ratio_c=0.5 is invalid: it must be > 1"):
        actor_loss_fn(ActorConfig(clip_ratio_c=0.5))
    check_policy_options("gpg", PolicyLossOptions(clip_ratio_c=0.5))  # gpg has no dual clip: nothing to refuse
