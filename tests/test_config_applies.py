"""No option silently does nothing: every key of the configuration reference is read by the package, a key read only
in some runs says where (the reference's "applies to", :mod:`jppo.config.applies`), and a key the chosen rollout
engine does not read is refused when set."""

from __future__ import annotations

import ast
import inspect
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

from jppo.advantages import ADVANTAGE_ESTIMATORS
from jppo.config import ConfigError, load_config
from jppo.config.applies import APPLIES, ENGINE_KEYS, ESTIMATOR_OPTIONS, POLICY_OPTIONS, applies_to
from jppo.config.reference import keys
from jppo.losses import POLICY_LOSSES, PolicyLossOptions
from jppo.run import build  # noqa: F401 (loads every component's config check, as the commands do)

ROOT = pathlib.Path(__file__).resolve().parents[1]
QUICKSTART_GRPO = ROOT / "configs" / "quickstart_grpo.yaml"
# Where a key is validated, not used: reads there do not count as the run reading it.
VALIDATORS = {"jppo/config/check.py", "jppo/run/checks.py", "jppo/config/applies.py",
              "jppo/config/reference.py", "jppo/core/checks.py"}
# Keys whose only reader is a check, by their last name, each with why that is enough (a check that refuses every
# value but the default): none today (lora.dropout, refused unless 0, is also written to a PEFT export's config).
READ_ONLY_BY_A_CHECK: dict[str, str] = {}


def _reads() -> set[str]:
    """Every attribute name the package reads (``x.name`` loaded, or ``getattr(x, "name")``) outside the validators
    and outside functions that only check (``check``, ``_check*``, ``__post_init__``)."""
    found = set()

    def visit(node: ast.AST, checking: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = checking
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = checking or child.name in ("check", "__post_init__") or child.name.startswith("_check")
            if not inner and isinstance(child, ast.Attribute) and isinstance(child.ctx, ast.Load):
                found.add(child.attr)
            if (not inner and isinstance(child, ast.Call) and getattr(child.func, "id", None) == "getattr"
                    and len(child.args) >= 2 and isinstance(child.args[1], ast.Constant)):
                found.add(child.args[1].value)
            visit(child, inner)

    for path in sorted((ROOT / "jppo").rglob("*.py")):
        if str(path.relative_to(ROOT)) not in VALIDATORS:
            visit(ast.parse(path.read_text()), False)
    return found


def test_every_key_of_the_reference_is_read_by_the_package():
    """A key is read where it is used (its section's field, or the component field of the same name it is passed
    on as: engine_view, PolicyLossOptions, ModelConfig), not only where it is checked; a new key nobody reads
    fails here."""
    reads = _reads()
    unread = [key.name for key in keys() if key.name.split(".")[-1] not in reads | set(READ_ONLY_BY_A_CHECK)]
    assert not unread, f"keys of the reference read nowhere in jppo/: {unread}"
    assert all(name not in reads for name in READ_ONLY_BY_A_CHECK)  # else the allow-list entry is stale


def test_every_applies_to_entry_names_keys_of_the_reference():
    names = [key.name for key in keys()]
    for entry in (*APPLIES, *ENGINE_KEYS):
        assert any(name == entry or (entry.endswith(".") and name.startswith(entry)) for name in names), entry
    assert applies_to("model.dtype") == ""  # every run, SFT's too
    assert applies_to("rollout.n") == "RL runs (`jppo.train`), not SFT (`jppo.sft`)"
    eps = applies_to("critic.optim.eps")
    assert eps.startswith("RL runs (`jppo.train`), not SFT (`jppo.sft`); a run with a critic")
    assert eps.endswith("`critic.optim.name: adamw`")
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert "| `rollout.max_num_seqs` |" in page and "`rollout.engine: jppo` (refused with vllm" in page


def test_the_estimator_options_apply_to_the_estimators_that_take_them():
    parameter = {"algorithm.gamma": "gamma", "algorithm.lam": "lam", "algorithm.norm_adv_by_std_in_grpo": "norm_by_std"}
    for key, names in ESTIMATOR_OPTIONS.items():
        takers = {name for name, estimator in ADVANTAGE_ESTIMATORS.items()
                  if parameter[key] in inspect.signature(estimator.fn).parameters}
        assert takers == set(names), key


def test_the_policy_options_apply_to_the_losses_they_change():
    """Each policy loss's per-token loss, with each option moved from its default: a loss listed for an option
    changes with it, a loss not listed does not (ratios spread over [e^-1.5, e^1.5], advantages of
    both signs, so every clip, gate and truncation is reached)."""
    rng = np.random.default_rng(0)
    old = jnp.asarray(np.log(rng.uniform(0.05, 0.95, (8, 16))), jnp.float32)
    new = old + jnp.asarray(rng.uniform(-1.5, 1.5, (8, 16)), jnp.float32)
    advantages = jnp.asarray(rng.normal(size=(8, 16)), jnp.float32)
    mask = jnp.ones((8, 16), bool)
    base = {"dro_beta": 0.1}  # dro requires one
    moved = {"clip_ratio": 0.5, "clip_ratio_low": 0.05, "clip_ratio_high": 0.6, "clip_ratio_c": 1.5, "tau_pos": 3.0,
             "tau_neg": 3.0, "dro_beta": 0.5}
    assert set(moved) == {field for field in PolicyLossOptions.__dataclass_fields__}

    def per_token(name, options):
        return np.asarray(POLICY_LOSSES[name](new, old, advantages, mask, PolicyLossOptions(**options)).loss)

    for name in POLICY_LOSSES:
        reference = per_token(name, base)
        for option, value in moved.items():
            differs = not np.array_equal(reference, per_token(name, {**base, option: value}))
            listed = name in POLICY_OPTIONS[f"actor.{option}"]
            assert differs == listed, f"actor.{option} for policy_loss {name}: changes it {differs}, listed {listed}"


@pytest.mark.parametrize("overrides,message", [
    (["rollout.engine=vllm", "rollout.max_num_seqs=4"],
     "rollout.max_num_seqs=4 is jppo's sampler's; rollout.engine='vllm' does not read it: set "
     "rollout.vllm.max_num_seqs=4 instead"),
    (["rollout.engine=vllm", "rollout.cache_blocks=2"],
     "rollout.cache_blocks='2' is jppo's sampler's response cache; rollout.engine='vllm' does not read it"),
    (["rollout.engine=vllm", "rollout.devices=2", "rollout.vllm.num_servers=1"],
     "rollout.devices=2 with rollout.vllm.num_servers=1: with rollout.engine=vllm both give the rollout its servers; "
     "set one"),
    (["rollout.engine=vllm", "rollout.devices=1", "rollout.vllm.servers=[h:1]"],
     "rollout.devices=1 with rollout.vllm.servers=['h:1']: with rollout.engine=vllm both give the rollout its "
     "servers; set one"),
    (["rollout.vllm.max_num_seqs=8"],
     "rollout.vllm.max_num_seqs=8 is read only with rollout.engine=vllm and this run samples with jppo's sampler "
     "(rollout.engine='jppo'): jppo's sampler's is rollout.max_num_seqs=8"),
    (["rollout.vllm.gpu_memory_utilization=0.5"],
     "rollout.vllm.gpu_memory_utilization=0.5 is read only with rollout.engine=vllm and this run samples with "
     "jppo's sampler (rollout.engine='jppo'): set rollout.engine=vllm, or remove it"),
    (["actor.lora.rank=4", "actor.use_kl_loss=true", "ref.param_dtype=bfloat16"],
     "ref.param_dtype='bfloat16' with actor.lora.rank=4: the KL reference is the LoRA policy's own frozen base, read "
     "in place"),
])
def test_a_key_the_run_would_not_read_is_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config(QUICKSTART_GRPO, overrides)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_the_same_keys_are_accepted_where_they_are_read():
    cfg = load_config(QUICKSTART_GRPO, ["rollout.max_num_seqs=4", "rollout.cache_blocks=2"])
    assert (cfg.rollout.max_num_seqs, cfg.rollout.cache_blocks) == (4, "2")
    cfg = load_config(QUICKSTART_GRPO, ["actor.use_kl_loss=true", "ref.param_dtype=bfloat16"])  # a copy, kept so
    assert cfg.ref.param_dtype == "bfloat16"
    # past the engine's keys, to vLLM's own checks: not installed, or (CI installs its CPU build) the quickstart
    # model's head size 8 that the CPU build has no attention for
    with pytest.raises(ConfigError, match="^rollout.engine='vllm'( needs vLLM|: vLLM's CPU build has no attention)"):
        load_config(QUICKSTART_GRPO, ["rollout.engine=vllm", "rollout.vllm.max_num_seqs=4"])


QUICKSTART_SFT = ROOT / "configs" / "quickstart_sft.yaml"


@pytest.mark.parametrize("overrides,message", [
    (["algorithm.adv_estimator=grpo"], "algorithm.adv_estimator='grpo' is read by RL runs only (python -m jppo.train); "
                                       "python -m jppo.sft does not read it: remove it"),
    (["data.train_batch_size=3"], "data.train_batch_size=3 is read by RL runs only (python -m jppo.train); python -m "
                                  "jppo.sft does not read it: SFT's rows per step are sft.batch_size"),
    (["actor.ppo_mini_batch_size=16"], "actor.ppo_mini_batch_size=16 is read by RL runs only"),
    (["critic.optim.lr=0.1"], "critic.optim.lr=0.1 is read by RL runs only"),
    (["actor.clip_ratio=0.3"], "actor.clip_ratio=0.3 is read by RL runs only"),
    (["rollout.n=4"], "rollout.n=4 is read by RL runs only"),
    (["rollout.vllm.max_num_seqs=3"], "rollout.vllm.max_num_seqs=3 is read by RL runs only"),
    (["trainer.off_policy_steps=1"], "trainer.off_policy_steps=1 is read by RL runs only"),
])
def test_an_sft_config_refuses_a_key_only_rl_runs_read_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config(QUICKSTART_SFT, overrides)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_the_rl_checks_demand_nothing_of_an_sft_config():
    """A token budget below what an RL run's rows take (prompt and response limits: 32 + 16 tokens) but above every
    SFT row (sft.max_length=16): the RL run refuses it, the SFT run takes it; an RL config refuses an sft key."""
    budget = ["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len=16", "data.max_prompt_length=32",
              "rollout.max_response_length=16"]
    with pytest.raises(ConfigError, match="^actor.ppo_max_token_len=16 must be >= the longest sequence"):
        load_config(QUICKSTART_GRPO, budget)
    cfg = load_config(QUICKSTART_SFT, budget)
    assert cfg.actor.ppo_max_token_len == 16
    with pytest.raises(ConfigError) as error:
        load_config(QUICKSTART_GRPO, ["sft.batch_size=4"], sft=False)
    assert str(error.value) == ("sft.batch_size=4 is read by python -m jppo.sft only, and this config is checked as "
                                "an RL run's: run it with python -m jppo.sft, or remove it")
