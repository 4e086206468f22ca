"""A learned reward: a value-head checkpoint scoring each sequence by its output at the last response token."""

from __future__ import annotations

import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jppo.core.experience import Experience
from jppo.engine import forward_batch, reward_model_fn
from jppo.models import load_pretrained


class RewardModel:
    """``model(batch) -> [N]`` scores; ``forward_cut`` is how the forward pass cuts the batch (``micro_batch_size``
    or ``max_token_len``, as :func:`jppo.engine.forward_batch` takes it)."""

    def __init__(self, path: str, dtype: str, mesh: Mesh, forward_cut: dict):
        model = load_pretrained(path, dtype=dtype, head="value", mesh=mesh)
        self._graphdef, self._params = nnx.split(model, nnx.Param)
        self._fn = reward_model_fn(self._graphdef)
        self._mesh = mesh
        self._cut = forward_cut

    def __call__(self, batch: Experience) -> np.ndarray:
        after_token = forward_batch(self._fn, self._params, batch, self._mesh, **self._cut)
        attention = batch.response_attention.astype(bool)
        last = attention.shape[1] - 1 - np.argmax(attention[:, ::-1], axis=1)
        return np.where(attention.any(axis=1), after_token[np.arange(len(last)), last], 0.0).astype(np.float32)
