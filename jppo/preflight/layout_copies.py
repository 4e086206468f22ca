"""The copies of stacked weights XLA:GPU lays out anew, with the dimension ``fsdp`` splits outermost, for the
layer loop's gathers: the memory plan's layout terms on a GPU (:mod:`jppo.preflight.memory`: a forward pass's
copy in place of a cast, and the experts' stacks the update's optimizer loop carries so laid out)."""

from __future__ import annotations

import math

from jppo.models.config import ModelConfig
from jppo.preflight.footprint import abstract_params, dtype_bytes, shards


def layout_copy_bytes(config: ModelConfig, mesh: dict[str, int], stored: str) -> int:
    """One device's shard of the model's largest stacked layer weight (``[layers, ...]``) in its ``stored`` dtype:
    in a forward pass XLA:GPU copies that stack into the layout the layer loop's products read, where XLA:TPU and a
    cast copy of the weights do not appear (compiled: Qwen2.5-0.5B and 7B log-prob passes on H100 and H200, the
    copy ``f32[3584/8, 28, 18944]`` at 7B on fsdp 8). A tied embedding's shard is copied too, into the LM head's
    layout (``f32[112, 151936]`` beside the stack's copy in Qwen2.5-0.5B's old-log-prob pass on fsdp 8: XLA:GPU's
    memory-usage report); an untied head is stored in its product's layout (the 7B's pass holds no such copy). A
    model with experts has every stack of its experts copied so, beside the largest other stack (Qwen3-30B-A3B's
    old log-probs on h200x8, fsdp 2 x expert 4: three ``f32[1024, 48, 32, 768]`` and ``f32[1024, 48, 4096]``)."""
    from flax import nnx  # noqa: PLC0415

    from jppo.models.sharding import logical_names  # noqa: PLC0415

    local = {path: math.prod(v.shape) // shards(v.shape, logical_names(v), mesh)
             for path, v in nnx.to_flat_state(abstract_params(config))}
    from jppo.models.moe import EXPERTS  # noqa: PLC0415

    stacks = [size for path, size in local.items() if "layers" in map(str, path) and str(path[-1]) not in EXPERTS]
    table = sum(size for path, size in local.items() if "embed_tokens" in map(str, path)) * config.tie_word_embeddings
    return (max(stacks, default=0) + table) * dtype_bytes(stored) + expert_layout_bytes(config, mesh, stored)


def expert_layout_bytes(config: ModelConfig, mesh: dict[str, int], stored: str) -> int:
    """One device's shard of every stack of the model's experts (and routers) in its ``stored`` dtype: what XLA:GPU
    copies into the layout the layer loop's gathers read, in a forward pass (:func:`layout_copy_bytes`) and in the
    update, whose optimizer loop carries the experts' float32 stacks so laid out; 0 without experts. The update
    counts one such copy of the parameters' stacks, where Qwen3-30B-A3B's on h200x8 holds five of its twelve
    ``f32[1024, 48, 32, 768]`` stacks of parameters, moments and accumulator so (22.5 GiB, against the 13.5 counted):
    its plan is within 1% of XLA's bytes with the other terms, which over-count the rest."""
    from flax import nnx  # noqa: PLC0415

    from jppo.models.moe import EXPERTS  # noqa: PLC0415
    from jppo.models.sharding import logical_names  # noqa: PLC0415

    if not config.sparse_layers:
        return 0
    local = sum(math.prod(v.shape) // shards(v.shape, logical_names(v), mesh)
                for path, v in nnx.to_flat_state(abstract_params(config)) if str(path[-1]) in EXPERTS)
    return local * dtype_bytes(stored)
