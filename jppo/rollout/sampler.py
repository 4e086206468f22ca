"""The sampler as a training run calls it: a list of prompts in, this process's rows of an ``Experience`` out; and
the host-side left-padding of prompts to bucketed widths, so that one compilation serves every batch of a bucket."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jppo.core.experience import Experience
from jppo.core.registry import Registry
from jppo.models.config import ModelConfig
from jppo.parallel.hostlocal import local_rows, replicated_on, to_global, to_local
from jppo.parallel.mesh import decoding_shards
from jppo.rollout.decode import SamplingParams, make_generate_fn


def bucket_length(length: int, multiple: int = 64) -> int:
    """The smallest positive multiple of ``multiple`` that is ``>= length``: the padded prompt width."""
    if multiple < 1:
        raise ValueError(f"bucket multiple={multiple} is invalid: it must be an integer >= 1")
    if length < 0:
        raise ValueError(f"prompt length={length} is invalid: it must be >= 0")
    return max(1, math.ceil(length / multiple)) * multiple


def pad_prompts(
    prompts: Sequence[Sequence[int]], pad_id: int, length: int | None = None, *, multiple: int = 64
) -> tuple[np.ndarray, np.ndarray]:
    """Left-pads token lists into ``(ids [B, L] int32, mask [B, L] bool)`` on the host.

    ``L`` is ``length`` if given, else ``bucket_length(longest prompt, multiple)``, so batches whose longest prompt
    falls in the same bucket share one compiled sampler. An empty prompt gives an all-padding row (and an empty
    response).
    """
    if not prompts:
        raise ValueError("pad_prompts got no prompts: pass at least one token list")
    longest = max(len(p) for p in prompts)
    width = bucket_length(longest, multiple) if length is None else length
    ids = np.full((len(prompts), width), pad_id, dtype=np.int32)
    mask = np.zeros((len(prompts), width), dtype=bool)
    for row, tokens in enumerate(prompts):
        if len(tokens) > width:
            raise ValueError(f"prompt {row} has {len(tokens)} tokens, more than the padded length {width}")
        if len(tokens):
            ids[row, width - len(tokens) :] = tokens
            mask[row, width - len(tokens) :] = True
    return ids, mask


class Sampler:
    """Samples ``params.n`` responses per prompt, rows sharded over the batch axes of ``mesh``.

    Prompts are left-padded to a multiple of ``bucket`` tokens and the batch is filled with empty rows (dropped
    again) up to a multiple of the pieces the sampler cuts its prompts into (every batch axis, ``sequence``
    included: :func:`~jppo.parallel.mesh.decoding_shards`), so the sampler compiles once per bucket and each device
    decodes whole prompts of its own. Every process passes the same prompt list and gets back the rows of its own
    shards.
    """

    def __init__(self, graphdef: nnx.GraphDef, pad_id: int, mesh: Mesh, params: SamplingParams, bucket: int):
        self._fn = make_generate_fn(graphdef, params)
        self._mesh = mesh
        self._pad = pad_id
        self._bucket = bucket
        self.params = params

    def __call__(self, state: nnx.State, prompts: list[list[int]], key: jax.Array) -> Experience:
        """This process's sequences; ``group_ids`` holds each row's index in ``prompts``."""
        filler = (-len(prompts)) % decoding_shards(self._mesh.shape)
        ids, mask = pad_prompts(list(prompts) + [[]] * filler, self._pad, multiple=self._bucket)
        mine = local_rows(self._mesh, len(ids))
        if not key.sharding.device_set <= set(self._mesh.devices.flat):  # the training mesh's key, for a sampler
            key = replicated_on(key, self._mesh)  # on a mesh of its own
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
            routed_experts=None if out.routed_experts is None else local(out.routed_experts),
        )


@dataclasses.dataclass(frozen=True)
class RolloutEngineSpec:
    """What a rollout engine is started with, once per run: the policy's architecture (as the sampler computes:
    ``dtype``), the longest context a request can reach (prompt and response tokens), the run's seed, the
    engine's own options (``rollout.<engine>``, None for jppo's) and the policy module as built (an external
    engine starts from its Hugging Face form)."""

    model: ModelConfig
    max_model_len: int
    seed: int
    options: Any = None
    policy: Any = None


# rollout.engine: name -> start(RolloutEngineSpec) -> an engine with ``sampler(graphdef, pad_id, mesh, params, bucket)``
# (a callable like Sampler) and ``push(state)`` (the policy's weights into the engine; False when it had them).
ROLLOUT_ENGINES: Registry[Callable[[RolloutEngineSpec], Any]] = Registry("rollout engine")


@ROLLOUT_ENGINES.register("jppo")
class JppoEngine:
    """jppo's own KV-cache sampler, the default and the reference: it runs the trainer's model function on the
    trainer's arrays, so there is nothing to start and no weight to push."""

    pushes_weights = False

    def __init__(self, spec: RolloutEngineSpec):
        del spec

    def sampler(self, graphdef: nnx.GraphDef, pad_id: int, mesh: Mesh, params: SamplingParams, bucket: int) -> Sampler:
        return Sampler(graphdef, pad_id, mesh, params, bucket)

    def push(self, state: nnx.State) -> bool:
        del state
        return False
