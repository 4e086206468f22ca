"""The workload most benchmarks time: one jppo actor optimizer step on a synthetic batch, on one device.

The step is the trainer's own :class:`jppo.engine.UpdateStep` (PPO clipped policy loss through ``agg_loss`` with
whole-mini-batch NormStats, K micro-batches scanned into ``optax.MultiSteps``, clipping, AdamW), fed the same
``[M, K, D, ...]`` micro-batch arrays the trainer builds, with M = 1 optimizer step.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx

from jppo.core.experience import Experience
from jppo.engine import ActorConfig, UpdateStep, actor_loss_fn, init_train_state
from jppo.engine.layout import place
from jppo.engine.microbatch import make_micro_batches, stack_micro_batches
from jppo.models import CausalLM, ModelConfig, create_model
from jppo.parallel.mesh import make_mesh


@dataclasses.dataclass(frozen=True)
class BatchShape:
    """``rows`` sequences of ``prompt`` prompt tokens and up to ``response`` response tokens."""

    rows: int
    prompt: int
    response: int

    @property
    def length(self) -> int:
        return self.prompt + self.response

    @property
    def tokens(self) -> int:
        """Tokens the model runs on per step (padding included): what tokens/s counts."""
        return self.rows * self.length


def synthetic_batch(shape: BatchShape, vocab: int, *, ragged: bool, seed: int = 0) -> Experience:
    """Random prompts and responses with old log-probs and advantages. ``ragged``: response lengths drawn from
    ``[response / 2, response]`` (the trainer's usual case); otherwise every row is full (no padding at all, so a
    peer implementation without masking does exactly the same work)."""
    rng = np.random.default_rng(seed)
    rows, response = shape.rows, shape.response
    lengths = rng.integers(response // 2, response + 1, rows) if ragged else np.full(rows, response)
    present = np.arange(response)[None, :] < lengths[:, None]
    per_token = {
        "old_log_prob": np.where(present, -rng.uniform(5, 8, (rows, response)), 0).astype(np.float32),
        "advantages": np.where(present, rng.normal(size=(rows, response)), 0).astype(np.float32),
    }
    return Experience(
        prompt_ids=rng.integers(1, vocab, (rows, shape.prompt)).astype(np.int32),
        prompt_mask=np.ones((rows, shape.prompt), bool),
        response_ids=np.where(present, rng.integers(1, vocab, (rows, response)), 0).astype(np.int32),
        response_mask=present,
        response_attention=present,
        **per_token,
    )


def model_summary(cfg: ModelConfig) -> dict:
    """The shape of a model as reported next to its numbers."""
    fields = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
              "tie_word_embeddings", "dtype", "param_dtype")
    return {name: getattr(cfg, name) for name in fields}


class ActorUpdate:
    """A jppo actor model, its optimizer state and one mini-batch placed on a one-device mesh.

    Calling it runs one optimizer step over the mini-batch and waits for it; it returns the step's metrics
    (host floats). The state is donated and replaced at every call, so repeated calls keep training.
    """

    def __init__(self, model_cfg: ModelConfig, actor_cfg: ActorConfig, batch: Experience, *, seed: int = 0):
        if actor_cfg.use_dynamic_bsz:
            raise ValueError("ActorUpdate times fixed micro-batches; set use_dynamic_bsz=False")
        # C of the update: the response width
        actor_cfg = dataclasses.replace(actor_cfg, loss_scale_factor=float(batch.response_ids.shape[1]))
        mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
        graphdef, params = nnx.split(create_model(CausalLM, model_cfg, mesh, seed=seed), nnx.Param)
        self.state = init_train_state(params, actor_cfg, mesh)
        self._step = UpdateStep(graphdef, actor_loss_fn(actor_cfg), actor_cfg, mesh, "actor")
        micro = make_micro_batches(batch, 1, micro_batch_size=actor_cfg.ppo_micro_batch_size)
        self._arrays = place(stack_micro_batches([micro]).device_arrays(), mesh, scanned=2)

    def host_params(self) -> dict:
        """The current parameters as a nested dict of numpy arrays (copy them out before a step donates them)."""
        return jax.tree.map(np.asarray, nnx.to_pure_dict(jax.device_get(self.state.params)))

    def __call__(self) -> dict[str, float]:
        self.state, metrics, _ = self._step(self.state, self._arrays)
        return {name: float(values[0]) for name, values in jax.device_get(metrics).items()}
