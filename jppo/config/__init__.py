"""The trainer's configuration: one typed schema, loaded from YAML plus ``key.sub=value`` overrides.

The schema (:mod:`jppo.config.schema`) is a tree of frozen dataclasses with verl's section and key names (``data``,
``model``, ``actor``, ``critic``, ``ref``, ``rollout``, ``reward``, ``algorithm``, ``mesh``, ``trainer``); the values
are in the units a user writes (``ppo_mini_batch_size`` counts prompts). :func:`load_config`
(:mod:`jppo.config.load`) merges the file and the overrides onto it and checks keys and types;
:func:`jppo.config.check.check` then checks every value, and :mod:`jppo.config.views` derives what each component is
given, in its own units. Every problem is a :class:`~jppo.core.errors.ConfigError` (one line naming the key and the
value); the command-line entry points print it and exit with status 2, before anything is compiled.

The configuration layer stands alone: importing this package, and loading and checking a config, loads
``jppo.config`` and ``jppo.core`` only. The records the schema composes are declared in ``jppo.core``
(:mod:`jppo.core.settings`, :mod:`jppo.core.inputs`), and what needs a component (a registry's names, a model's
shape, a checkpoint to resume) is that component's check, registered in :data:`jppo.core.checks.CONFIG_CHECKS` by
the module that knows the limit and run by :func:`load_config` after the config's own: every command loads them all
before it reads its config (:mod:`jppo.run.checks`). ``check_mesh`` (:func:`jppo.config.devices.check_mesh`)
loads the engine when first asked for.
"""

from jppo.config.load import CONFIG_HELP, load_config, save_config, to_dict
from jppo.config.schema import (
    RANDOM_MODEL,
    ActorSection,
    AlgorithmSection,
    CriticSection,
    FilterGroupsSection,
    KLControlSection,
    MeshSection,
    ModelSection,
    RefSection,
    RolloutSection,
    TrainConfig,
    TrainerSection,
    UpdateSectionFields,
)
from jppo.core.errors import ConfigError
from jppo.core.lazy import lazy_exports

__getattr__ = lazy_exports(__name__, {"devices": ("check_mesh",)})[0]  # the validator loads when first asked for

__all__ = [
    "CONFIG_HELP", "RANDOM_MODEL", "ActorSection", "AlgorithmSection", "ConfigError", "CriticSection",
    "FilterGroupsSection", "KLControlSection", "MeshSection", "ModelSection", "RefSection", "RolloutSection",
    "TrainConfig", "TrainerSection", "UpdateSectionFields", "check_mesh", "load_config", "save_config",
    "to_dict",
]
