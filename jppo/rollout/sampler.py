"""The sampler as a training run calls it: a list of prompts in, this process's rows of an ``Experience`` out."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jppo.core.experience import Experience
from jppo.parallel.hostlocal import local_rows, to_global, to_local
from jppo.parallel.mesh import batch_shards
from jppo.rollout.decode import SamplingParams, make_generate_fn, pad_prompts


class Sampler:
    """Samples ``params.n`` responses per prompt, rows sharded over the batch axes of ``mesh``.

    Prompts are left-padded to a multiple of ``bucket`` tokens and the batch is filled up to a multiple of the
    batch shards with empty rows (dropped again), so the sampler compiles once per bucket. Every process passes the
    same prompt list and gets back the rows of its own shards.
    """

    def __init__(self, graphdef: nnx.GraphDef, pad_id: int, mesh: Mesh, params: SamplingParams, bucket: int):
        self._fn = make_generate_fn(graphdef, params)
        self._mesh = mesh
        self._pad = pad_id
        self._bucket = bucket
        self.params = params

    def __call__(self, state: nnx.State, prompts: list[list[int]], key: jax.Array) -> Experience:
        """This process's sequences; ``group_ids`` holds each row's index in ``prompts``."""
        filler = (-len(prompts)) % batch_shards(self._mesh)
        ids, mask = pad_prompts(list(prompts) + [[]] * filler, self._pad, multiple=self._bucket)
        mine = local_rows(self._mesh, len(ids))
        with jax.set_mesh(self._mesh):
            out = self._fn(state, to_global(ids[mine.start : mine.stop], self._mesh),
                           to_global(mask[mine.start : mine.stop], self._mesh), key)
        group_ids = np.repeat(np.arange(mine.start, mine.stop), self.params.n)
        keep = group_ids < len(prompts)  # filler prompts come last
        rows = range(mine.start * self.params.n, mine.stop * self.params.n)

        def local(array: jax.Array) -> np.ndarray:
            return to_local(array, rows=rows)[keep]

        return Experience(
            prompt_ids=local(out.prompt_ids), prompt_mask=local(out.prompt_mask), response_ids=local(out.response_ids),
            response_mask=local(out.response_mask), rollout_log_prob=np.asarray(local(out.log_probs), np.float32),
            group_ids=group_ids[keep],
        )
