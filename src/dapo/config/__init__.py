"""Typed, validated configuration: dataclasses with help text, presets, YAML and overrides.

Every run is described by one :class:`Config`. It is built in this order: defaults, then the
named preset (``preset: dapo`` by default), then the YAML file, then the command-line
overrides. Unknown keys and bad values raise :class:`ConfigError` naming the key, the value
and the fix.

- :mod:`dapo.config.schema`: the section dataclasses; every field carries its help text
  (and, if enumerated, its choices) as field metadata. ``dapo train --help-config`` prints it.
- :mod:`dapo.config.presets`: the named presets (the DAPO paper's ablation ladder, Dr. GRPO).
- :mod:`dapo.config.loading`: YAML, ``key.path=value`` overrides, coercion, aliases, checks.
"""

from dapo.config.loading import (
    _all_keys,
    config_from_dict,
    load_config,
    parse_override,
    validate,
)
from dapo.config.presets import ABLATION_LADDER, PRESETS, describe_presets
from dapo.config.schema import (
    AlgorithmConfig,
    CheckpointConfig,
    Config,
    DataConfig,
    LoggingConfig,
    LoraConfig,
    ModelConfig,
    RewardConfig,
    RewardFunctionConfig,
    RolloutConfig,
    TrainConfig,
    describe_config,
    opt,
)
from dapo.errors import ConfigError

__all__ = [
    "ABLATION_LADDER",
    "PRESETS",
    "AlgorithmConfig",
    "CheckpointConfig",
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
    "_all_keys",
    "config_from_dict",
    "describe_config",
    "describe_presets",
    "load_config",
    "opt",
    "parse_override",
    "validate",
]
