"""Hugging Face checkpoints: ``config.json`` + ``*.safetensors`` in, the same out.

Hugging Face stores a linear layer's weight as ``[out, in]`` and one tensor per layer; jppo stores kernels as
``[in, out]`` and stacks the layers (``decoder.py``). A family's ``tensor_names`` (:mod:`jppo.models.families`) is
the only place that knows the correspondence: jppo parameter path -> (Hugging Face name, with ``{i}`` for the layer,
transposed or not).
Loading reads, for every device, only the slice of each tensor that device holds, and places it with its
sharding (``jax.make_array_from_callback``): no parameter exists unsharded on one device on the way.
"""

from __future__ import annotations

import json
import pathlib
from typing import Callable, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jppo.core.paths import run_path
from jppo.models.config import DTYPES, ModelConfig
from jppo.models.decoder import CausalLM
from jppo.models.moe import stacked_layers
from jppo.models.safetensors_io import SafetensorsFile, write_sharded_safetensors
from jppo.models.sharding import variable_spec
from jppo.models.value import ValueHead, ValueModel

Array = jax.Array
PathLike = str | pathlib.Path


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be read into (or written as) a jppo model."""


HEADS = {"lm": CausalLM, "value": ValueModel}


def _hf_names(key: str, table: Mapping[str, tuple[str, bool]], config: ModelConfig) -> tuple[list, bool]:
    """The Hugging Face tensor names behind jppo parameter ``key``: one per layer when stacked (the layers its
    stack holds: :func:`~jppo.models.moe.stacked_layers`), a list per layer of one per expert for the experts."""
    template, transposed = table[key]
    if not key.startswith("decoder.layers."):
        return [template], transposed
    layers = stacked_layers(key.rsplit(".", 1)[1], config)
    if "{j}" in template:
        return [[template.format(i=i, j=j) for j in range(config.num_experts)] for i in layers], transposed
    return [template.format(i=i) for i in layers], transposed


def _stacked_depth(key: str, table: Mapping[str, tuple[str, bool]]) -> int:
    """How many leading axes of parameter ``key`` index checkpoint tensors: 0, 1 (layers), 2 (layers, experts)."""
    if not key.startswith("decoder.layers."):
        return 0
    return 2 if "{j}" in table[key][0] else 1


class _Checkpoint:
    """The tensors of a checkpoint directory: ``model.safetensors`` or an index and its shards."""

    def __init__(self, path: pathlib.Path):
        index, single = path / "model.safetensors.index.json", path / "model.safetensors"
        if index.exists():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        elif single.exists():
            weight_map = dict.fromkeys(SafetensorsFile(single).names(), single.name)
        else:
            raise CheckpointError(f"{path} has neither model.safetensors nor model.safetensors.index.json")
        self._path = path
        self._weight_map = weight_map
        self._files: dict[str, SafetensorsFile] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._weight_map

    def tensor(self, name: str) -> np.ndarray:
        if name not in self._weight_map:
            raise CheckpointError(f"{self._path}: missing tensor {name}")
        filename = self._weight_map[name]
        if filename not in self._files:
            if not (self._path / filename).exists():
                raise CheckpointError(f"{self._path}: shard {filename} (holding {name}) does not exist")
            self._files[filename] = SafetensorsFile(self._path / filename)
        return self._files[filename].tensor(name)


def read_config(path: PathLike, **overrides) -> ModelConfig:
    """The :class:`ModelConfig` of a checkpoint directory's ``config.json`` (``overrides``: jppo-only fields)."""
    path = pathlib.Path(path)
    config_file = path / "config.json"
    if not config_file.exists():
        raise CheckpointError(f"missing config.json in {path}")
    try:
        return ModelConfig.from_hf(json.loads(config_file.read_text()), **overrides)
    except ValueError as error:
        raise CheckpointError(f"{config_file}: {error}") from error


def _tensor_reader(
    checkpoint: _Checkpoint, names: list, transposed: bool, depth: int, expected: tuple[int, ...]
) -> Callable[[tuple[slice, ...]], np.ndarray]:
    """A function from an index of the jppo parameter (shape ``expected``, whose ``depth`` leading axes index the
    nested lists of ``names``) to that slice as a host array."""
    per_tensor = expected[depth:]
    hf_shape = per_tensor[::-1] if transposed else per_tensor

    def open_all(names, depth):
        if depth == 0:
            tensor = checkpoint.tensor(names)
            if tuple(tensor.shape) != tuple(hf_shape):
                raise CheckpointError(f"tensor {names}: expected shape {tuple(hf_shape)}, found {tuple(tensor.shape)}")
            return tensor
        return [open_all(name, depth - 1) for name in names]

    tensors = open_all(names if depth else names[0], depth)

    def piece(tensor: np.ndarray, index: tuple[slice, ...]) -> np.ndarray:
        return np.asarray(tensor[index[::-1]]).T if transposed else np.asarray(tensor[index])

    def gather(tensors, index: tuple[slice, ...], depth: int) -> np.ndarray:
        if depth == 0:
            return piece(tensors, index)
        return np.stack([gather(tensors[i], index[1:], depth - 1) for i in range(len(tensors))[index[0]]])

    return lambda index: gather(tensors, index, depth)


def _place(read: Callable, variable: nnx.Variable, mesh: Mesh | None) -> Array:
    shape, dtype = variable.shape, variable.dtype
    if mesh is None:
        return jnp.asarray(read((slice(None),) * len(shape)).astype(dtype))
    sharding = NamedSharding(mesh, variable_spec(variable, mesh))
    return jax.make_array_from_callback(shape, sharding, lambda index: read(index).astype(dtype))


def load_pretrained(
    path: PathLike,
    *,
    dtype: str | None = None,
    param_dtype: str | None = None,
    head: str = "lm",
    mesh: Mesh | None = None,
    seed: int = 0,
    remat: bool | None = None,
    attention: str | None = None,
    layer_loop: str | None = None,
    attention_block_q: int | None = None,
    attention_block_kv: int | None = None,
    expert_chunk_size: int | None = None,
) -> CausalLM | ValueModel:
    """A :class:`CausalLM` (``head="lm"``) or :class:`ValueModel` (``head="value"``) from a Hugging Face
    checkpoint directory, each parameter placed straight onto its sharding over ``mesh`` when given.

    ``dtype``/``param_dtype`` default to float32 (the checkpoint's own dtype is converted); ``remat`` (default
    off) recomputes each layer in the backward pass; ``attention`` (default ``reference``), its block sizes,
    ``layer_loop`` (default ``auto``) and ``expert_chunk_size`` (default 0) are ModelConfig's. For ``"value"`` the
    decoder comes from the checkpoint and the value head too if it has ``score.weight`` (a critic checkpoint);
    otherwise (a policy checkpoint, as verl initialises critics) the head is new, drawn from ``seed``.
    Raises :class:`CheckpointError` naming the missing file or tensor, the mismatched shape, or the
    unsupported ``model_type``.
    """
    if head not in HEADS:
        raise ValueError(f"unknown head {head!r}; valid: {', '.join(HEADS)}")
    path = pathlib.Path(path)
    given = (("dtype", dtype), ("param_dtype", param_dtype), ("remat", remat), ("attention", attention),
             ("layer_loop", layer_loop), ("attention_block_q", attention_block_q),
             ("attention_block_kv", attention_block_kv), ("expert_chunk_size", expert_chunk_size))
    overrides = {key: value for key, value in given if value is not None}
    config = read_config(path, **overrides)
    checkpoint = _Checkpoint(path)
    cls = HEADS[head]
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(seed))))
    table = config.family.tensor_names
    new_head = head == "value" and "score.weight" not in checkpoint
    fresh = nnx.state(ValueHead(config, rngs=nnx.Rngs(seed))) if new_head else None

    def load(path_parts: tuple, variable: nnx.Variable) -> nnx.Variable:
        key = ".".join(str(part) for part in path_parts)
        if new_head and key.startswith("value_head."):
            value = np.asarray(fresh[path_parts[-1]][...])
            read = lambda index: value[index]  # noqa: E731
        elif key == "value_head.bias" and "score.bias" not in checkpoint:  # a score layer saved without bias
            read = lambda index: np.zeros(variable.shape)[index]  # noqa: E731
        else:
            names, transposed = _hf_names(key, table, config)
            read = _tensor_reader(checkpoint, names, transposed, _stacked_depth(key, table), variable.shape)
        return variable.replace(_place(read, variable, mesh))

    return nnx.merge(graphdef, nnx.map_state(load, abstract))


def save_pretrained(
    model: CausalLM | ValueModel, path: PathLike, *, dtype: str | None = None, max_shard_bytes: int | None = None,
    to_host: Callable[[Array], np.ndarray] | None = None,
) -> list[str]:
    """Writes ``config.json`` and the weights that transformers loads: a :class:`CausalLM` as ``*ForCausalLM``, a
    :class:`ValueModel` as ``*ForTokenClassification``; returns the names of the files written.

    ``dtype``: the stored dtype (default: the parameter dtype), also written as the config's ``dtype``.
    ``max_shard_bytes``: above it the weights are cut into shards plus ``model.safetensors.index.json``
    (default: one ``model.safetensors``). One jppo parameter at a time is brought to the host by ``to_host``
    (default ``jax.device_get``: single-process only)."""
    head = {CausalLM: "lm", ValueModel: "value"}.get(type(model))
    if head is None:
        raise CheckpointError(f"cannot save a {type(model).__name__}; expected CausalLM or ValueModel")
    config = model.config
    dtype = dtype or config.param_dtype
    if dtype not in DTYPES:
        raise CheckpointError(f"cannot save weights as dtype={dtype!r}; valid: {', '.join(DTYPES)}")
    path = run_path(path)  # a local folder or a gs:// URI
    path.mkdir(parents=True, exist_ok=True)
    layout, sources = [], {}
    for name, variable, layer, transposed in hf_layout(model):
        shape = variable.shape[len(layer):]
        layout.append((name, shape[::-1] if transposed else shape, np.dtype(DTYPES[dtype])))
        sources[name] = (variable, layer, transposed)
    to_host = to_host or (lambda array: np.asarray(jax.device_get(array)))
    fetch = _host_tensors(sources, lambda variable: to_host(variable[...]))

    hf_config = config.to_hf(head) | {"dtype": dtype}
    (path / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    return ["config.json", *write_sharded_safetensors(path, layout, fetch, max_shard_bytes)]


# one Hugging Face tensor: (its name, the jppo variable holding it, its index in the variable's leading axes (layer,
# expert; () for a variable that is one tensor), transposed)
HFTensor = tuple[str, nnx.Variable, tuple[int, ...], bool]


def hf_layout(model: CausalLM | ValueModel) -> list[HFTensor]:
    """Where each Hugging Face tensor of ``model`` lies in its jppo parameters, in the order of the parameters (so
    a reader that walks it gathers one parameter, all its layers, at a time)."""
    table, out = model.config.family.tensor_names, []
    for path_parts, variable in nnx.to_flat_state(nnx.state(model)):
        key = ".".join(str(part) for part in path_parts)
        names, transposed = _hf_names(key, table, model.config)
        depth = _stacked_depth(key, table)
        if depth == 0:
            out.append((names[0], variable, (), transposed))
        elif depth == 1:
            out.extend((name, variable, (layer,), transposed) for layer, name in enumerate(names))
        else:
            out.extend((name, variable, (layer, expert), transposed) for layer, per_expert in enumerate(names)
                       for expert, name in enumerate(per_expert))
    return out


def _host_tensors(sources: Mapping[str, tuple], to_host: Callable[[nnx.Variable], np.ndarray]):
    """``fetch(name)``: the Hugging Face tensor ``name`` (``[out, in]`` for a linear layer) as a view into the host
    copy of its jppo parameter; one parameter is kept on the host at a time."""
    host: dict[int, np.ndarray] = {}

    def fetch(name: str) -> np.ndarray:
        variable, layer, transposed = sources[name]
        if id(variable) not in host:
            host.clear()
            host[id(variable)] = to_host(variable)
        array = host[id(variable)][layer]
        return array.T if transposed else array

    return fetch


def hf_tensors(
    model: CausalLM | ValueModel, to_host: Callable[[Array], np.ndarray]
) -> Iterator[tuple[str, np.ndarray]]:
    """``(Hugging Face name, host array)`` of every tensor of ``model``, as ``save_pretrained`` writes them, without
    a file: ``to_host`` brings one jppo parameter (all its layers) to the host (e.g. gathered from its shards),
    and each tensor is a view into that copy (a layer of it, transposed where Hugging Face stores ``[out, in]``)."""
    layout = hf_layout(model)
    fetch = _host_tensors({name: (v, layer, t) for name, v, layer, t in layout}, lambda v: to_host(v[...]))
    for name, *_ in layout:
        yield name, fetch(name)
