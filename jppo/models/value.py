"""The critic: the decoder of :mod:`jppo.models.decoder` with a scalar value head (``value_head`` in the
decoder's parameter layout table)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jppo.models.config import ModelConfig
from jppo.models.decoder import CausalLM, Decoder, normal_weights
from jppo.models.layers import wide
from jppo.models.sharding import param, param_shardings
from jppo.parallel.hostlocal import placed

Array = jax.Array


class ValueHead(nnx.Module):
    """``hidden [..., D] -> hidden w + b`` (float32 ``[...]``), initialised like transformers' score layer:
    ``w ~ N(0, initializer_range)``, ``b = 0``."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.kernel = param(normal_weights(rngs, (config.hidden_size, 1), config), ("embed", "value"))
        self.bias = param(jnp.zeros((1,), config.weight_dtype), ("value",))

    def __call__(self, hidden: Array) -> Array:
        kernel = self.kernel[...].astype(self.config.compute_dtype)
        values = jnp.einsum("...d,do->...o", hidden, kernel, preferred_element_type=wide(kernel.dtype))
        return (values + self.bias[...].astype(values.dtype))[..., 0]


class ValueModel(nnx.Module):
    """Critic: the same decoder with a scalar head, ``values [B, T]`` float32."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, decoder: Decoder | None = None):
        self.config = config
        self.decoder = Decoder(config, rngs=rngs) if decoder is None else decoder
        self.value_head = ValueHead(config, rngs=rngs)

    def __call__(self, input_ids: Array, positions: Array | None = None, segment_ids: Array | None = None) -> Array:
        return self.value_head(self.hidden_states(input_ids, positions, segment_ids))

    def hidden_states(
        self, input_ids: Array, positions: Array | None = None, segment_ids: Array | None = None
    ) -> Array:
        return self.decoder(input_ids, positions, segment_ids)

    @classmethod
    def from_policy(cls, policy: CausalLM, *, rngs: nnx.Rngs) -> ValueModel:
        """A critic whose decoder is a copy of ``policy``'s (own buffers, same shardings) and whose value head
        is new (verl initialises its critic from the policy checkpoint the same way). On a mesh the new head
        is placed on its own sharding there."""
        graphdef, state = nnx.split(policy.decoder)
        decoder = nnx.merge(graphdef, jax.tree.map(lambda array: array.copy(), state))
        model = cls(policy.config, rngs=rngs, decoder=decoder)
        sharding = policy.decoder.embed_tokens[...].sharding
        if isinstance(sharding, jax.sharding.NamedSharding):
            head = nnx.state(model.value_head)
            nnx.update(model.value_head, placed(head, param_shardings(head, sharding.mesh)))
        return model
