"""The configuration: DeepSpeed's JSON schema, parsed once into typed pydantic models.

Existing ``ds_config.json`` files work unchanged. Every mistake becomes a :class:`ConfigError`
naming the key path, the bad value and what is allowed; ``"auto"`` values are resolved here,
explicitly, and logged (DeepSpeed drops them silently). One module per job: ``base`` (the error
and the strict section base), ``sections``/``zero``/``parallel`` (the section models), ``model``
(the whole config and the batch triad), ``source`` (reading files, ``"auto"``), ``errors`` (one
line per mistake), ``compat`` (what DeepSpeed accepts that does nothing here).
"""

from slipstream.engine.config.base import AUTO, ConfigError, Section, unsupported
from slipstream.engine.config.compat import IGNORED_SECTIONS, NO_EFFECT, warn_no_effect
from slipstream.engine.config.errors import did_you_mean, format_validation_error, known_keys
from slipstream.engine.config.model import BatchValue, SlipstreamConfig, load_config
from slipstream.engine.config.parallel import (
    ALL_AXES,
    AXES,
    AXIS_KEYS,
    ContextParallelConfig,
    ExpertParallelConfig,
    MeshSizes,
    PipelineConfig,
    TensorParallelConfig,
    mesh_sizes,
)
from slipstream.engine.config.sections import (
    ActivationCheckpointingConfig,
    AioConfig,
    BF16Config,
    CheckpointConfig,
    CheckpointParallelWriteConfig,
    CommsLoggerConfig,
    CSVMonitorConfig,
    FlopsProfilerConfig,
    FP16Config,
    OptimizerConfig,
    SchedulerConfig,
    TensorBoardConfig,
    TorchAutocastConfig,
    WandbConfig,
)
from slipstream.engine.config.source import USE_DEFAULT, read_config_source, resolve_auto
from slipstream.engine.config.zero import STAGE3_ALIASES, OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig

__all__ = [
    "ALL_AXES",
    "AUTO",
    "AXES",
    "AXIS_KEYS",
    "ActivationCheckpointingConfig",
    "AioConfig",
    "BF16Config",
    "BatchValue",
    "CSVMonitorConfig",
    "CheckpointConfig",
    "CheckpointParallelWriteConfig",
    "CommsLoggerConfig",
    "ConfigError",
    "ContextParallelConfig",
    "ExpertParallelConfig",
    "FP16Config",
    "FlopsProfilerConfig",
    "IGNORED_SECTIONS",
    "MeshSizes",
    "NO_EFFECT",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "PipelineConfig",
    "STAGE3_ALIASES",
    "SchedulerConfig",
    "Section",
    "SlipstreamConfig",
    "TensorBoardConfig",
    "TensorParallelConfig",
    "TorchAutocastConfig",
    "USE_DEFAULT",
    "WandbConfig",
    "ZeroConfig",
    "did_you_mean",
    "format_validation_error",
    "known_keys",
    "load_config",
    "mesh_sizes",
    "read_config_source",
    "resolve_auto",
    "unsupported",
    "warn_no_effect",
]
