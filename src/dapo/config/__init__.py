"""Typed, validated configuration: dataclasses with help text, presets, YAML and overrides.

Every run is described by one :class:`Config`. It is built in this order: defaults, then the
named preset (``preset: dapo`` by default), then the YAML file, then the command-line
overrides. Unknown keys and bad values raise :class:`ConfigError` naming the key, the value
and the fix.

- :mod:`dapo.config.fields`: :func:`opt` declares a field (default, help text, bounds such
  as ``ge=0, le=1``); :func:`~dapo.config.fields.check_fields` checks every field against its
  bounds and its ``Literal`` type's choices (:mod:`dapo.choices`).
- :mod:`dapo.config.schema` (and :mod:`dapo.config.algorithm`): the section dataclasses.
- :mod:`dapo.config.rules`: the rules between fields, one function per section; ``validate``.
- :mod:`dapo.config.presets`: the named presets (the DAPO paper's ablation ladder, Dr. GRPO).
- :mod:`dapo.config.loading`: YAML, ``key.path=value`` overrides, coercion, aliases.
- :mod:`dapo.config.describe`: ``dapo train --help-config``.

Torch-free, and it imports nothing of dapo but :mod:`dapo.choices` and :mod:`dapo.errors`
(``dapo presets`` and the reward workers load it without torch).
"""

from dapo.config.algorithm import AlgorithmConfig
from dapo.config.describe import describe_config
from dapo.config.fields import Bounds, opt
from dapo.config.loading import (
    all_keys,
    config_from_dict,
    load_config,
    parse_override,
    read_config_file,
)
from dapo.config.presets import ABLATION_LADDER, PRESETS, describe_presets
from dapo.config.rules import validate
from dapo.config.schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    HealthConfig,
    LoggingConfig,
    LoraConfig,
    ModelConfig,
    RewardConfig,
    RewardFunctionConfig,
    RolloutConfig,
    TrainConfig,
)
from dapo.errors import ConfigError

__all__ = [
    "ABLATION_LADDER",
    "PRESETS",
    "AlgorithmConfig",
    "Bounds",
    "CheckpointConfig",
    "HealthConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "LoggingConfig",
    "LoraConfig",
    "ModelConfig",
    "RewardConfig",
    "RewardFunctionConfig",
    "RolloutConfig",
    "TrainConfig",
    "all_keys",
    "config_from_dict",
    "describe_config",
    "describe_presets",
    "load_config",
    "opt",
    "parse_override",
    "read_config_file",
    "validate",
]
