"""Typed run configuration (torch-free, so the curve service and launcher import it cheaply).

A run is described by one `RunConfig`. Built-in configs live in `scalerl/configs/*.yaml`;
any field can be overridden from the command line (`--set learner.lr=2e-5`) or from the
environment (`SCALERL_LEARNER__LR=2e-5`). One module per section: `model` (a variant per
kind), `task`, `rollout` (its `engine` variants, one per inference engine, in `engine`),
`learner` (its `loss` variants, one per policy loss, in `loss`; its `weights` variants,
one per transport, in `weights`), `services` (eval, fleet, curve, security) and `run`
(the whole and its loading).
"""

from scalerl.config.distill import DistillConfig
from scalerl.config.engine import (
    EngineConfig,
    SglangEngineConfig,
    TorchEngineConfig,
    VllmEngineConfig,
)
from scalerl.config.learner import LearnerConfig, LoraConfig
from scalerl.config.loss import (
    LOSS_HYPERPARAMETERS,
    CispoLoss,
    DapoLoss,
    GrpoLoss,
    GspoLoss,
    LossConfig,
)
from scalerl.config.mismatch import (
    MISMATCHES,
    RATIO_HISTOGRAM_EDGES,
    IcePopMismatch,
    MismatchConfig,
    MisSequenceMismatch,
    MisTokenMismatch,
    NoMismatch,
    TisMismatch,
)
from scalerl.config.model import ModelConfig, PathModel, SmolLM2Model, TinyModel
from scalerl.config.rollout import DEFAULT_INTERRUPT_TEXT, RolloutConfig
from scalerl.config.run import (
    CONFIG_DIR,
    ENV_PREFIX,
    RunConfig,
    dump_config,
    environment_overrides,
    load_config,
    parse_override,
    resolve_config_path,
    resolve_key,
)
from scalerl.config.services import CurveConfig, EvalConfig, FleetConfig, SecurityConfig
from scalerl.config.task import (
    ADDITIONS_SYSTEM_PROMPT,
    TASK_SOURCES,
    AdditionsTaskConfig,
    CodeVerifierConfig,
    EnvironmentConfig,
    EpisodesTaskConfig,
    FileTaskConfig,
    JudgeVerifierConfig,
    McpServerConfig,
    OpenEnvConfig,
    ReasoningGymTaskConfig,
    RewardModelVerifierConfig,
    TaskConfig,
    VerifierConfig,
    task_config,
)
from scalerl.config.weights import (
    BroadcastWeights,
    PullWeights,
    StreamWeights,
    UriWeights,
    WeightsConfig,
)

__all__ = [
    "DistillConfig",
    "ADDITIONS_SYSTEM_PROMPT",
    "AdditionsTaskConfig",
    "BroadcastWeights",
    "CONFIG_DIR",
    "CispoLoss",
    "DapoLoss",
    "GrpoLoss",
    "GspoLoss",
    "LossConfig",
    "MISMATCHES",
    "RATIO_HISTOGRAM_EDGES",
    "IcePopMismatch",
    "MismatchConfig",
    "MisSequenceMismatch",
    "MisTokenMismatch",
    "NoMismatch",
    "TisMismatch",
    "CurveConfig",
    "DEFAULT_INTERRUPT_TEXT",
    "ENV_PREFIX",
    "EngineConfig",
    "EvalConfig",
    "FleetConfig",
    "LOSS_HYPERPARAMETERS",
    "LearnerConfig",
    "LoraConfig",
    "ModelConfig",
    "PathModel",
    "PullWeights",
    "RolloutConfig",
    "RunConfig",
    "SecurityConfig",
    "SglangEngineConfig",
    "SmolLM2Model",
    "StreamWeights",
    "TASK_SOURCES",
    "TaskConfig",
    "CodeVerifierConfig",
    "JudgeVerifierConfig",
    "RewardModelVerifierConfig",
    "EnvironmentConfig",
    "EpisodesTaskConfig",
    "FileTaskConfig",
    "McpServerConfig",
    "OpenEnvConfig",
    "ReasoningGymTaskConfig",
    "VerifierConfig",
    "TinyModel",
    "TorchEngineConfig",
    "UriWeights",
    "VllmEngineConfig",
    "WeightsConfig",
    "dump_config",
    "environment_overrides",
    "load_config",
    "task_config",
    "parse_override",
    "resolve_config_path",
    "resolve_key",
]
