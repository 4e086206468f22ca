"""What a checkpoint's models were built from: the record its meta holds (the shape's keys, the seed, the
adapters, the checksums of LoRA's frozen bases), read back and compared with a config's before anything is built, so
that a resume, an evaluation or an export rebuilds the models whose arrays the checkpoint holds."""

from __future__ import annotations

import logging
from typing import Optional, Sequence

from jppo.config import RANDOM_MODEL, ConfigError, TrainConfig
from jppo.config.views import CHECKPOINT_OVERRIDES, random_model_config, tokenizer_spec
from jppo.data import load_tokenizer
from jppo.models import read_config
from jppo.run.build import ROLES
from jppo.run.checkpoint import fingerprint
from jppo.run.state import RunState

log = logging.getLogger("jppo.run.record")

# The model keys of a policy's shape and initialisation (CHECKPOINT_OVERRIDES apply to any checkpoint: not its origin)
SHAPE_KEYS = tuple(f"model.{name}" for name in RANDOM_MODEL if name not in CHECKPOINT_OVERRIDES)
# The critic's shape in a record: critic.model_path's config.json, or the policy's shape (and vocabulary) without it
CRITIC_SHAPE_KEYS = tuple(f"critic.{key.split('.')[1]}" for key in (*SHAPE_KEYS, "model.vocab_size"))
MODELS_META = "models"  # the entry of a checkpoint's meta that records what its models were built from


def model_record(cfg: TrainConfig, seed: int, checksums: Optional[dict[str, Optional[str]]] = None) -> dict:
    """What the models of a run are built from, by config key: a checkpoint's meta records it (``models``), since
    a checkpoint leaves out what the run can rebuild (LoRA's frozen base weights; a KL reference copied from the
    initial policy). ``trainer.seed``: the seed the random weights were drawn from; the policy's shape (the
    ``model.*`` keys of a random model, of ``model.path``'s ``config.json`` for a loaded one); whether a critic
    trains; each role's adapters; and ``<role>.base_checksum``, the :func:`~jppo.run.checkpoint.fingerprint` of a LoRA
    role's frozen base when it is loaded from a file (``checksums``; a random base is the seed and the keys).
    ``model.vocab_size`` (the embedding's rows: ``config.json``'s, or the tokenizer's for a random model) and the
    critic's shape (``critic.<key>``: ``critic.model_path``'s, else the policy's) are recorded where they can be
    read; a record without them (an older checkpoint) is not compared on them."""
    record = {"trainer.seed": seed, "model.path": cfg.model.path, "critic.enable": cfg.use_critic,
              "critic.model_path": cfg.critic.model_path}
    shape = read_config(cfg.model.path) if cfg.model.path else random_model_config(cfg, None)
    record.update({key: getattr(shape, key.split(".")[1]) for key in SHAPE_KEYS})
    vocab = vocab_size(cfg)
    if vocab is not None:
        record["model.vocab_size"] = vocab
    if cfg.use_critic:
        critic = read_config(cfg.critic.model_path) if cfg.critic.model_path else None
        for key, policy_key in zip(CRITIC_SHAPE_KEYS, (*SHAPE_KEYS, "model.vocab_size")):
            name = key.split(".")[1]
            record[key] = getattr(critic, name) if critic is not None else record.get(policy_key)
    for role in ROLES:
        lora = getattr(cfg, role).lora
        record.update({f"{role}.lora.rank": lora.rank, f"{role}.lora.alpha": lora.alpha,
                       f"{role}.lora.target_modules": sorted(lora.target_modules)})
        record[f"{role}.base_checksum"] = (checksums or {}).get(role)
    # as the checkpoint's JSON meta holds it (a tuple such as model.mlp_only_layers reads back as a list)
    return {key: list(value) if isinstance(value, tuple) else value for key, value in record.items()}


def vocab_size(cfg: TrainConfig) -> Optional[int]:
    """The rows of the policy's embedding: ``model.path``'s ``config.json``, or the tokenizer's vocabulary for a
    random model; None when the tokenizer does not load (the run refuses it elsewhere)."""
    if cfg.model.path:
        return read_config(cfg.model.path).vocab_size
    try:
        return load_tokenizer(tokenizer_spec(cfg)).vocab_size
    except (ValueError, KeyError, OSError):
        return None


def saved_model_record(meta: dict) -> Optional[dict]:
    """The :func:`model_record` of a checkpoint's meta. A checkpoint written before jppo recorded it has only the
    config of the run that wrote it: the record is that config's (its ``trainer.seed`` drew the weights, unless
    that run was itself resumed with another seed), without checksums; None when that config no longer reads."""
    if MODELS_META in meta:
        return meta[MODELS_META]
    from omegaconf import OmegaConf  # noqa: PLC0415 (only an old checkpoint needs it)

    try:
        saved = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), meta["config"]))
        record = model_record(saved, saved.trainer.seed)
    except Exception:  # noqa: BLE001 (a meta of another jppo version: nothing to compare)
        return None
    return {key: value for key, value in record.items() if not key.endswith("_checksum")}  # unknown, not "random"


def checkpoint_models(cfg: TrainConfig, meta: dict, source: str) -> tuple[int, Optional[dict]]:
    """``(seed, record)`` for rebuilding the models of the checkpoint ``source`` (its ``meta``): the seed its record
    holds (so a resume, an evaluation or an export with another ``trainer.seed`` gets the trained policy), once
    :func:`check_model_record` let this config through; ``trainer.seed`` and None when it records nothing."""
    saved = saved_model_record(meta)
    if saved is None:
        log.warning("%s records no model origin: its models are built from this config", source)
        return cfg.trainer.seed, None
    check_model_record(saved, model_record(cfg, cfg.trainer.seed), source, tokenizer_spec(cfg))
    if saved["trainer.seed"] != cfg.trainer.seed:
        log.info("%s: models drawn from its seed %d (trainer.seed=%d drives the data order and sampling)",
                 source, saved["trainer.seed"], cfg.trainer.seed)
    return saved["trainer.seed"], saved


def check_model_record(saved: dict, current: dict, source: str, tokenizer: Optional[str] = None) -> None:
    """A :class:`ConfigError` naming the first key on which this config builds other models than the checkpoint
    ``source`` holds (the arrays would not fit, or the adapters would sit on another base), before anything is
    built. ``trainer.seed`` is not compared (the random weights are drawn from the checkpoint's seed), nor a
    path as such (a base that moved is the same base: its checksum decides, see :func:`check_base_checksums`);
    a role's keys only when both train it. ``tokenizer``: where this config's vocabulary comes from (its message)."""
    for key, value in saved.items():
        role = key.split(".")[0]
        if key not in current or key == "trainer.seed" or key.endswith(("model_path", ".path", "_checksum")):
            continue
        if role == "critic" and key != "critic.enable" and not (saved["critic.enable"] and current["critic.enable"]):
            continue
        if current[key] == value:
            continue
        if key in CRITIC_SHAPE_KEYS:  # the shape of critic.model_path's model (or of the policy's without it)
            was, now = saved["critic.model_path"], current["critic.model_path"]
            raise ConfigError(
                f"{source} was trained with critic.model_path={was!r} (a critic of {key}={value!r}), but this "
                f"config has critic.model_path={now!r} (a critic of {key}={current[key]!r})"
            )
        origin = f" (in model.path={current['model.path']!r})" if role == "model" and current["model.path"] else ""
        if key == "model.vocab_size" and not current["model.path"]:
            origin = f" (the vocabulary of the tokenizer {tokenizer!r})"
        raise ConfigError(
            f"{source} was trained with {key}={value!r}, but this config has {key}={current[key]!r}{origin}"
        )


def check_base_checksums(saved: dict, current: dict, source: str, roles: Sequence[str] = ROLES) -> None:
    """A :class:`ConfigError` when a LoRA role's frozen base (not in the checkpoint) differs from the one its
    adapters were trained on: other weights at ``model.path`` / ``critic.model_path``, or a loaded base where the
    checkpoint's was drawn at random (or the reverse). A checkpoint without checksums (written before jppo
    recorded them) is not checked; only ``roles`` (those built)."""
    for role in roles:
        key, lora = f"{role}.base_checksum", f"{role}.lora.rank"
        if key not in saved or not current.get(lora) or (role == "critic" and not current["critic.enable"]):
            continue
        path_key = "model.path" if role == "actor" or not current["critic.model_path"] else "critic.model_path"
        if saved[key] is None and current[key] is None:
            continue  # both drawn at random: from the same seed and keys (check_model_record)
        if saved[key] != current[key]:
            was = "drawn at random" if saved[key] is None else f"loaded from {saved.get(path_key)!r}"
            now = "draws it at random" if current[key] is None else f"loads {current.get(path_key)!r}"
            raise ConfigError(
                f"{source}: {role}.lora adapters were trained on a frozen base {was} (checksum {saved[key]}), but "
                f"this config's {path_key} {now} (checksum {current[key]}): other base weights"
            )


def run_model_record(cfg: TrainConfig, state: RunState, seed: int) -> dict:
    """:func:`model_record` of a built run, with the checksums of its LoRA bases loaded from files."""
    loaded = {"actor": cfg.model.path, "critic": cfg.critic.model_path or cfg.model.path}
    frozen = {"actor": state.actor.frozen, "critic": None if state.critic is None else state.critic.frozen}
    checksums = {role: fingerprint(frozen[role]) for role in ROLES if loaded[role] and frozen[role] is not None}
    return model_record(cfg, seed, checksums)
