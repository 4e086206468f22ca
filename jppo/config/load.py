"""YAML plus ``key.sub=value`` overrides -> a checked, frozen :class:`~jppo.config.schema.TrainConfig`.

OmegaConf merges the file and the overrides onto the schema and checks keys and types; model sources given as
Hugging Face repo ids are resolved to their cached snapshots (:func:`resolve_sources`), and
:func:`jppo.config.check.check` then checks every value: its own checks, then those the loaded components registered
(:mod:`jppo.run.checks` loads them all; every command imports it before it reads a config).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Any, Optional, Sequence

from etils import epath
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from jppo.config.applies import sets_sft
from jppo.config.schema import TrainConfig
from jppo.core.errors import ConfigError, one_line
from jppo.core.inputs import BUILTIN_PREFIX

# The --config help of every command line (train, eval, plan): what runs without a file.
CONFIG_HELP = (
    "YAML config. Without one the run uses the config schema's defaults (jppo/config/schema.py): verl-style "
    "hyper-parameters (e.g. actor.optim.lr=1e-6) on the built-in reverse_digits task with a tiny random model. "
    "They are not the quickstart, which is --config configs/quickstart.yaml"
)

# Settings that name a model or tokenizer: a local directory or a Hugging Face repo id (jppo.models.hub).
MODEL_SOURCE_KEYS = ("model.path", "model.tokenizer", "critic.model_path", "ref.model_path", "reward.model_path")


def resolve_sources(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with every :data:`MODEL_SOURCE_KEYS` value that is a cached Hugging Face repo id replaced by its
    local snapshot directory, so everything after this reads local directories only; an uncached id is a
    :class:`ConfigError`. The one place a model source is resolved (run by :func:`load_config`)."""
    sections: dict[str, dict[str, str]] = {}
    for key in MODEL_SOURCE_KEYS:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value is None or value.startswith(BUILTIN_PREFIX) or os.path.isdir(os.path.expanduser(value)):
            continue  # a local directory always wins (jppo.models.hub): nothing to look up
        from jppo.models.hub import local_model_dir  # noqa: PLC0415 (a repo id: the cache's reader loads now)

        resolved = local_model_dir(key, value)
        if resolved != value:
            sections.setdefault(section, {})[name] = resolved
    changes = {section: dataclasses.replace(getattr(cfg, section), **names) for section, names in sections.items()}
    return dataclasses.replace(cfg, **changes) if changes else cfg


def _omegaconf_message(error: OmegaConfBaseException) -> str:
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    key = getattr(error, "full_key", None)
    return f"{key}: {text}" if key and key not in text else text


def _reset_options_of_a_replaced_task(file_layer, command_line: list) -> None:
    """A ``data.task`` given on the command line that differs from the file's starts from that task's own default
    options plus those given with it: the file's ``data.task_options`` belong to the file's task (merged, they would
    reach the new task, which rejects them)."""
    tasks = [layer.data.task for layer in command_line
             if isinstance(layer.get("data"), DictConfig) and "task" in layer.data]
    if not tasks or not isinstance(file_layer, DictConfig) or not isinstance(file_layer.get("data"), DictConfig):
        return
    if file_layer.data.get("task") != tasks[-1] and "task_options" in file_layer.data:
        del file_layer.data["task_options"]


def _leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{dotted key: value}`` of a nested mapping; a list is a leaf."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for name, value in tree.items():
        out.update(_leaves(value, f"{prefix}.{name}" if prefix else str(name)))
    return out


def _nested(key: str, value: Any) -> dict:
    for name in reversed(key.split(".")):
        value = {name: value}
    return value


def _culprit(merged, layer) -> Optional[str]:
    """Which leaf of ``layer`` does not merge, and for a list which element, in one line; None if none alone fails.
    (OmegaConf's error about a list element names neither the key nor the value: ``Value '$VALUE' ...``.)"""
    for key, value in _leaves(OmegaConf.to_container(layer, resolve=False)).items():
        try:
            OmegaConf.merge(merged, _nested(key, value))
            continue
        except OmegaConfBaseException as error:
            reason = str(error).splitlines()[0].replace("Value '$VALUE' of type '$VALUE_TYPE' ", "")
        for index, element in enumerate(value if isinstance(value, list) else []):
            try:
                OmegaConf.merge(merged, _nested(key, [element]))
            except OmegaConfBaseException:
                return f"{key}={value!r} is invalid: its element {index}, {element!r}, {reason}"
        return f"{key}={value!r} is invalid: {reason}"
    return None


def _merged(merged, layer, where: str):
    """``merged`` with ``layer`` merged on top; a mismatch is a :class:`ConfigError` naming ``where``."""
    try:
        return OmegaConf.merge(merged, layer)
    except OmegaConfBaseException as error:
        if not getattr(error, "full_key", None):  # a list element's: OmegaConf names neither the key nor the value
            raise ConfigError(_culprit(merged, layer) or f"{where} is invalid: {_omegaconf_message(error)}") from None
        raise ConfigError(_omegaconf_message(error)) from None
    except (TypeError, ValueError) as error:  # e.g. a list where the schema has a mapping
        raise ConfigError(f"{where} is invalid: {one_line(error)}") from None


def _override_layer(item: str):
    """One ``key.sub=value`` override as a config layer; the value is parsed as YAML (a number, a list, ...)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form key.sub=value")
    try:
        return OmegaConf.from_dotlist([item])
    except Exception as error:  # noqa: BLE001 (yaml's parser errors are not ValueErrors)
        raise ConfigError(f"override {item!r} is not valid YAML ({one_line(error)})") from None


def vllm_on_rollout_devices(cfg: TrainConfig) -> TrainConfig:
    """``rollout.devices: N`` with ``rollout.engine: vllm`` is the rollout on devices of its own as vLLM runs it:
    N servers this run starts, ``rollout.vllm.num_servers: N`` (on a GPU node each on a GPU the trainer does not
    use, :func:`jppo.rollout.vllm_server.split_gpus`). Resolved here, so the meshes (``rollout.devices`` 0) and
    the servers read one key each; the saved config shows the servers."""
    n, vllm = cfg.rollout.devices, cfg.rollout.vllm
    if cfg.rollout.engine != "vllm" or not isinstance(n, int) or n <= 0:
        return cfg
    if vllm.num_servers or vllm.servers:
        key, value = (("rollout.vllm.num_servers", vllm.num_servers) if vllm.num_servers else
                      ("rollout.vllm.servers", list(vllm.servers)))
        raise ConfigError(f"rollout.devices={n} with {key}={value!r}: with rollout.engine=vllm both give the "
                          "rollout its servers; set one")
    rollout = dataclasses.replace(cfg.rollout, devices=0, vllm=dataclasses.replace(vllm, num_servers=n))
    return dataclasses.replace(cfg, rollout=rollout)


def load_config(
    path: str | pathlib.Path | None, overrides: Sequence[str] = (), data_files: bool = True,
    sft: bool | None = None,
) -> TrainConfig:
    """The schema defaults, then the YAML file, then ``key.sub=value`` overrides; validated and frozen.
    ``data_files`` False: the prompt files are not looked for (a command that needs only shapes). ``sft``: checked
    as the config of an SFT run (True: ``python -m jppo.sft``'s; a key only RL runs read is refused when set) or of
    an RL run (False: an ``sft`` key set is refused); None: an SFT config when it sets a key of the ``sft`` section
    to other than its default (:func:`~jppo.config.applies.sets_sft`).

    Layers are merged one at a time, so a value of the wrong shape is reported with the override (or file) that
    brought it. Replacing ``data.task`` on the command line drops the file's ``data.task_options``
    (:func:`_reset_options_of_a_replaced_task`)."""
    merged = OmegaConf.structured(TrainConfig)
    layers = [(_override_layer(item), item) for item in overrides]
    if path is not None:
        path = pathlib.Path(path)
        if not path.is_file():
            raise ConfigError(f"--config {str(path)!r}: no such file")
        try:
            layer = OmegaConf.load(path)
        except Exception as error:  # noqa: BLE001 (yaml errors come in several classes)
            raise ConfigError(f"--config {str(path)!r}: not valid YAML ({one_line(error)})") from None
        _reset_options_of_a_replaced_task(layer, [override for override, _ in layers])
        merged = _merged(merged, layer, f"--config {str(path)!r}")
    for layer, item in layers:
        merged = _merged(merged, layer, f"override {item!r}")
    try:
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as error:
        raise ConfigError(_omegaconf_message(error)) from None
    except ValueError as error:  # a section's own check (its message names the key)
        raise ConfigError(one_line(error)) from None
    from jppo.config.check import check  # noqa: PLC0415 (loaded with the first config)

    cfg = resolve_sources(cfg)  # Hugging Face repo ids -> cached snapshot directories
    cfg = vllm_on_rollout_devices(cfg)
    check(cfg, data_files, sets_sft(cfg) if sft is None else sft)
    return cfg


def to_dict(cfg: TrainConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def save_config(cfg: TrainConfig, path: str | os.PathLike) -> None:
    """The resolved configuration as YAML (what the run actually used)."""
    epath.Path(path).write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
