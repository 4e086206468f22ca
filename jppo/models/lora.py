"""Low-rank adapters (LoRA) on the decoder's projections, their merge into the base weights, and PEFT's layout
(written, and read back into a model's adapters).

For a target projection with kernel ``W [in, out]`` (every layer, stacked) the adapted layer computes
``y = x W + s (x A) B`` with ``A [in, r]``, ``B [r, out]`` and ``s = alpha / r``. ``B`` starts at zero, so the
adapted model starts equal to its base; ``A`` is drawn as PEFT draws it (Kaiming-uniform with ``a = sqrt(5)``:
``U(-1/sqrt(in), 1/sqrt(in))``). The adapters are ``nnx.LoRAParam`` variables of a :class:`LoRAAdapters` module
attached to ``decoder.layers.lora`` after the base model is built or loaded, so the base's parameters keep their
paths: the base alone is the model with the adapters switched off (the reference policy reads the same arrays).

Sharding: ``A`` carries ``(layers, <W's input name>, None)`` and ``B`` ``(layers, None, <W's output name>)``,
mapped to the mesh by the same rule table as every parameter.

PEFT stores ``lora_A.weight [r, in]`` and ``lora_B.weight [out, r]`` per layer (``Linear``'s ``[out, in]``
layout): ``A = lora_A.weight^T`` and ``B = lora_B.weight^T``; the merged Hugging Face weight is
``W_hf + s lora_B.weight @ lora_A.weight``.
"""

from __future__ import annotations

import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jppo.core.errors import InvalidSetting
from jppo.core.settings import LORA_TARGETS, LoRAConfig
from jppo.models.config import ModelConfig
from jppo.models.sharding import param_shardings

Array = jax.Array

def check_fits(lora: LoRAConfig, config: ModelConfig) -> None:
    """:class:`InvalidSetting` when ``rank`` exceeds the narrowest side of a target kernel (such an adapter is no
    longer low-rank: it only costs memory)."""
    shapes = target_shapes(config)
    targets = adapted_targets(config, lora)
    if not targets:
        raise InvalidSetting("lora.", "target_modules", sorted(lora.target_modules),
                             "at least one attention projection (q_proj, k_proj, v_proj, o_proj) on a model with "
                             "experts")
    limit = min(min(shapes[name][:2]) for name in targets)
    if lora.rank > limit:
        raise InvalidSetting("lora.", "rank", lora.rank, f"<= {limit} (the narrowest side of a target projection)")


ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def adapted_targets(config: ModelConfig, lora: LoRAConfig) -> tuple[str, ...]:
    """The targets that get adapters: all of ``target_modules``, except on a model with experts in some layer,
    where the MLP targets (``gate_proj``, ``up_proj``, ``down_proj``) are left out: the experts, the router and the
    dense MLP of its layers without experts stay frozen, and only the attention projections are adapted."""
    targets = tuple(name for name in LORA_TARGETS if name in lora.target_modules)
    return tuple(name for name in targets if name in ATTENTION_TARGETS) if config.sparse_layers else targets


def target_shapes(config: ModelConfig) -> dict[str, tuple[int, int, str, str]]:
    """``name -> (in, out, logical input name, logical output name)`` of each projection's kernel."""
    D, F = config.hidden_size, config.intermediate_size
    return {
        "q_proj": (D, config.q_size, "embed", "q_heads"),
        "k_proj": (D, config.kv_size, "embed", "kv_heads"),
        "v_proj": (D, config.kv_size, "embed", "kv_heads"),
        "o_proj": (config.q_size, D, "q_heads", "embed"),
        "gate_proj": (D, F, "embed", "mlp"),
        "up_proj": (D, F, "embed", "mlp"),
        "down_proj": (F, D, "mlp", "embed"),
    }


def _lora_param(value: Array, names: tuple) -> nnx.LoRAParam:
    from jppo.models.sharding import _RULES  # noqa: PLC0415 (the one rule table; sharding imports this module)

    return nnx.LoRAParam(value, out_sharding=names, sharding_rules=_RULES, eager_sharding=False)


class LoRAAdapters(nnx.Module):
    """``{name}_a [L, in, r]`` and ``{name}_b [L, r, out]`` for every target ``name``; ``scale = alpha / r``."""

    def __init__(self, config: ModelConfig, lora: LoRAConfig, *, rngs: nnx.Rngs):
        self.scale = float(lora.scale)
        self.targets = adapted_targets(config, lora)
        L, r, dtype = config.num_layers, lora.rank, config.weight_dtype
        for name in self.targets:
            fan_in, fan_out, in_name, out_name = target_shapes(config)[name]
            bound = 1.0 / math.sqrt(fan_in)
            a = jax.random.uniform(rngs.params(), (L, fan_in, r), dtype, -bound, bound)
            setattr(self, f"{name}_a", _lora_param(a, ("layers", in_name, None)))
            setattr(self, f"{name}_b", _lora_param(jnp.zeros((L, r, fan_out), dtype), ("layers", None, out_name)))

    def stacked(self) -> dict[str, tuple[Array, Array]]:
        """``name -> (A, B)``, stacked over layers (what the layer scan slices)."""
        return {name: (getattr(self, f"{name}_a")[...], getattr(self, f"{name}_b")[...]) for name in self.targets}


def attach_lora(model: nnx.Module, lora: LoRAConfig, seed: int) -> nnx.Module:
    """Adds adapters to ``model.decoder.layers`` (in place; returned for chaining), on the mesh of the base
    weights when they are sharded: each adapter laid out by the rule table. Also under ``nnx.eval_shape`` (the
    structure of an adapted model)."""
    lora.check()
    layers = model.decoder.layers
    check_fits(lora, layers.config)
    adapters = LoRAAdapters(layers.config, lora, rngs=nnx.Rngs(seed))
    kernel = layers.q_proj[...]
    sharding = None if isinstance(kernel, jax.core.Tracer) else kernel.sharding  # traced: an abstract model
    if isinstance(sharding, jax.sharding.NamedSharding):
        from jppo.parallel.hostlocal import placed  # noqa: PLC0415 (the config layer loads LoRAConfig from here)

        state = nnx.state(adapters)
        nnx.update(adapters, placed(state, param_shardings(state, sharding.mesh)))
    layers.lora = nnx.data(adapters)
    return model


def trainable_filter(model: nnx.Module):
    """What trains when the model carries adapters: the adapters, and a value model's new head (PEFT's
    ``modules_to_save``)."""
    if hasattr(model, "value_head"):
        return nnx.Any(nnx.LoRAParam, nnx.PathContains("value_head"))
    return nnx.LoRAParam


def delta(a: Array, b: Array, scale: float) -> Array:
    """``s A B``: the change an adapter makes to its (stacked) kernel, ``[L, in, out]``, in float32 at least."""
    wide = jnp.promote_types(a.dtype, jnp.float32)
    return scale * jnp.einsum("lir,lro->lio", a.astype(wide), b.astype(wide))


def merged(model: nnx.Module) -> nnx.Module:
    """The model without adapters whose target kernels are ``W + s A B`` (in the kernels' dtype): what the
    adapted model computes, as plain weights (host or device arrays alike). A model without adapters is returned
    as it is."""
    return _without_adapters(model, merge=True)


def base_model(model: nnx.Module) -> nnx.Module:
    """The frozen base the adapters sit on, without them: the kernels ``W`` as they are (what PEFT's
    ``PeftModel.from_pretrained(base, adapters)`` needs under the adapters, for a base drawn at random too)."""
    return _without_adapters(model, merge=False)


def _without_adapters(model: nnx.Module, merge: bool) -> nnx.Module:
    layers = model.decoder.layers
    adapters = getattr(layers, "lora", None)
    if adapters is None:
        return model
    base_graphdef = nnx.graphdef(nnx.eval_shape(lambda: type(model)(model.config, rngs=nnx.Rngs(0))))
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    kept = {path: variable for path, variable in flat.items() if "lora" not in path}
    for name, (a, b) in adapters.stacked().items() if merge else ():
        path = ("decoder", "layers", name)
        kernel = kept[path][...]
        kept[path] = kept[path].replace(
            (kernel.astype(jnp.promote_types(kernel.dtype, jnp.float32)) + delta(a, b, adapters.scale)).astype(
                kernel.dtype
            )
        )
    return nnx.merge(base_graphdef, nnx.from_flat_state(kept))


def peft_config(lora: LoRAConfig, base_model: str | None, targets: tuple[str, ...] | None = None) -> dict:
    """``adapter_config.json`` of a PEFT LoRA adapter for a causal LM (``targets``: the adapted ones, default all of
    ``target_modules``)."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout, "target_modules": sorted(targets or lora.target_modules), "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "init_lora_weights": True,
        "inference_mode": True, "modules_to_save": None, "base_model_name_or_path": base_model,
    }


def peft_tensors(adapters: LoRAAdapters, dtype: str | np.dtype) -> dict[str, np.ndarray]:
    """PEFT's tensor names and ``[out, in]`` layouts of the adapters, one per layer, on the host."""
    out = {}
    for name, (a, b) in adapters.stacked().items():
        a, b = np.asarray(jax.device_get(a)), np.asarray(jax.device_get(b))
        for i in range(a.shape[0]):
            prefix = f"base_model.model.model.layers.{i}.{LORA_TARGETS[name]}"
            out[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a[i].T).astype(dtype)
            out[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b[i].T).astype(dtype)
    return out


def save_peft_adapter(
    adapters: LoRAAdapters, lora: LoRAConfig, path: str | pathlib.Path, *, dtype: str = "float32",
    base_model: str | None = None,
) -> list[str]:
    """Writes ``adapter_config.json`` and ``adapter_model.safetensors`` (what ``peft.PeftModel.from_pretrained``
    loads onto the base model); returns the file names."""
    from safetensors.numpy import save_file  # noqa: PLC0415 (only when a PEFT adapter is written)

    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = peft_config(lora, base_model, adapters.targets)
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = peft_tensors(adapters, np.dtype(jnp.dtype(dtype)))
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    return ["adapter_config.json", "adapter_model.safetensors"]


# PEFT's file names of a LoRA adapter directory (beside a base model's weights: a model an RL run keeps training)
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def saved_adapter_config(path: str | pathlib.Path) -> dict | None:
    """``path``'s ``adapter_config.json`` when the directory holds LoRA adapters in PEFT's layout, else None."""
    file = pathlib.Path(path) / ADAPTER_CONFIG
    return json.loads(file.read_text()) if file.is_file() else None


def check_saved_adapters(saved: dict, lora: LoRAConfig, config: ModelConfig, where: str) -> None:
    """``ValueError`` (one line) unless the adapters ``saved`` describes (``adapter_config.json``) are the ones
    ``lora`` attaches to a model of ``config``: rank, alpha and targets, so that they load into them unchanged."""
    rank, alpha, targets = saved.get("r"), saved.get("lora_alpha"), sorted(saved.get("target_modules") or ())
    keep = f"set actor.lora.rank={rank} actor.lora.alpha={alpha} actor.lora.target_modules={targets}"
    if not lora.enabled:
        raise ValueError(f"{where} holds LoRA adapters ({ADAPTER_CONFIG}: r={rank}, lora_alpha={alpha}): {keep} to "
                         "keep training them, or start from the run's merged export (python -m jppo.export RUN OUT)")
    mine = (lora.rank, float(lora.alpha), sorted(adapted_targets(config, lora)))
    if mine != (rank, float(alpha if alpha is not None else math.nan), targets):
        raise ValueError(f"actor.lora (rank={lora.rank}, alpha={lora.alpha}, targets {mine[2]}) differs from the "
                         f"adapters {where} holds (r={rank}, lora_alpha={alpha}, targets {targets}): {keep}")


def load_saved_adapters(model: nnx.Module, path: str | pathlib.Path) -> None:
    """The adapters of ``model`` (attached, :func:`attach_lora`) replaced, in place, by those saved at ``path`` in
    PEFT's layout (``A = lora_A.weight^T``, ``B = lora_B.weight^T``, layer by layer), each in its adapter's dtype
    and sharding, so that the model computes what the saved one did and its training continues from them."""
    from jppo.models.safetensors_io import SafetensorsFile  # noqa: PLC0415

    adapters = model.decoder.layers.lora
    tensors = SafetensorsFile(pathlib.Path(path) / ADAPTER_WEIGHTS)
    layers = model.decoder.layers.config.num_layers
    for name in adapters.targets:
        for side, key in (("a", "lora_A"), ("b", "lora_B")):
            variable = getattr(adapters, f"{name}_{side}")
            current = variable[...]
            names = [f"base_model.model.model.layers.{i}.{LORA_TARGETS[name]}.{key}.weight" for i in range(layers)]
            value = np.stack([tensors.tensor(n).T for n in names]).astype(current.dtype)
            if value.shape != current.shape:
                raise ValueError(f"{path}/{ADAPTER_WEIGHTS}: {names[0]} is {value.shape[1:][::-1]}, the adapter "
                                 f"takes {current.shape[1:][::-1]}")
            variable.value = jax.make_array_from_callback(value.shape, current.sharding, lambda index: value[index])
