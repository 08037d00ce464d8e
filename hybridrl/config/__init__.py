"""Configuration: dataclass schema (``schema.py``, ``sections/``), typed conversion (``convert.py``)
and the strict YAML/CLI loader (``loader.py``)."""

from hybridrl.config.loader import (
    ConfigError,
    apply_overrides,
    dump_yaml,
    from_dict,
    load_config,
    to_dict,
)
from hybridrl.config.schema import (
    ActorConfig,
    AlgorithmConfig,
    AsyncConfig,
    Config,
    ControllerConfig,
    CriticConfig,
    FSDPConfig,
    ModelConfig,
    PoolConfig,
    RolloutConfig,
    SFTConfig,
    TaskConfig,
    TrainerConfig,
)

__all__ = [
    "ActorConfig",
    "AlgorithmConfig",
    "AsyncConfig",
    "Config",
    "ConfigError",
    "ControllerConfig",
    "CriticConfig",
    "FSDPConfig",
    "ModelConfig",
    "PoolConfig",
    "RolloutConfig",
    "SFTConfig",
    "TaskConfig",
    "TrainerConfig",
    "apply_overrides",
    "dump_yaml",
    "from_dict",
    "load_config",
    "to_dict",
]
