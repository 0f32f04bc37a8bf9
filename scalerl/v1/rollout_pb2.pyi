from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_INTERRUPTED: _ClassVar[FinishReason]
    FINISH_REASON_ABORTED: _ClassVar[FinishReason]
    FINISH_REASON_MAX_TURNS: _ClassVar[FinishReason]

class InterruptMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INTERRUPT_MODE_UNSPECIFIED: _ClassVar[InterruptMode]
    INTERRUPT_MODE_TRUNCATE: _ClassVar[InterruptMode]
    INTERRUPT_MODE_ABORT: _ClassVar[InterruptMode]

class WeightsFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WEIGHTS_FORMAT_UNSPECIFIED: _ClassVar[WeightsFormat]
    WEIGHTS_FORMAT_SAFETENSORS: _ClassVar[WeightsFormat]
    WEIGHTS_FORMAT_SAFETENSORS_DELTA: _ClassVar[WeightsFormat]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_INTERRUPTED: FinishReason
FINISH_REASON_ABORTED: FinishReason
FINISH_REASON_MAX_TURNS: FinishReason
INTERRUPT_MODE_UNSPECIFIED: InterruptMode
INTERRUPT_MODE_TRUNCATE: InterruptMode
INTERRUPT_MODE_ABORT: InterruptMode
WEIGHTS_FORMAT_UNSPECIFIED: WeightsFormat
WEIGHTS_FORMAT_SAFETENSORS: WeightsFormat
WEIGHTS_FORMAT_SAFETENSORS_DELTA: WeightsFormat

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "seed", "max_new_tokens")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    seed: int
    max_new_tokens: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., max_new_tokens: _Optional[int] = ...) -> None: ...

class LengthControl(_message.Message):
    __slots__ = ("thinking_budget", "answer_budget", "interrupt_text")
    THINKING_BUDGET_FIELD_NUMBER: _ClassVar[int]
    ANSWER_BUDGET_FIELD_NUMBER: _ClassVar[int]
    INTERRUPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    thinking_budget: int
    answer_budget: int
    interrupt_text: str
    def __init__(self, thinking_budget: _Optional[int] = ..., answer_budget: _Optional[int] = ..., interrupt_text: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_text", "prompt_token_ids", "sampling", "length_control", "adapter")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    LENGTH_CONTROL_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_text: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    length_control: LengthControl
    adapter: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_text: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., length_control: _Optional[_Union[LengthControl, _Mapping]] = ..., adapter: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "logprobs", "policy_versions", "forced", "finish_reason", "prompt_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    FORCED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    policy_versions: _containers.RepeatedScalarFieldContainer[int]
    forced: _containers.RepeatedScalarFieldContainer[bool]
    finish_reason: FinishReason
    prompt_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., policy_versions: _Optional[_Iterable[int]] = ..., forced: _Optional[_Iterable[bool]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class InterruptRequest(_message.Message):
    __slots__ = ("request_id", "mode")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    mode: InterruptMode
    def __init__(self, request_id: _Optional[str] = ..., mode: _Optional[_Union[InterruptMode, str]] = ...) -> None: ...

class InterruptResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class WeightsHeader(_message.Message):
    __slots__ = ("version", "format", "total_bytes", "sha256", "uri", "adapter", "base_version", "base_sha256", "delta_bytes", "delta_sha256")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    URI_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    BASE_SHA256_FIELD_NUMBER: _ClassVar[int]
    DELTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    DELTA_SHA256_FIELD_NUMBER: _ClassVar[int]
    version: int
    format: WeightsFormat
    total_bytes: int
    sha256: str
    uri: str
    adapter: str
    base_version: int
    base_sha256: str
    delta_bytes: int
    delta_sha256: str
    def __init__(self, version: _Optional[int] = ..., format: _Optional[_Union[WeightsFormat, str]] = ..., total_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., uri: _Optional[str] = ..., adapter: _Optional[str] = ..., base_version: _Optional[int] = ..., base_sha256: _Optional[str] = ..., delta_bytes: _Optional[int] = ..., delta_sha256: _Optional[str] = ...) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: WeightsHeader
    chunk: bytes
    def __init__(self, header: _Optional[_Union[WeightsHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("policy_version", "seconds")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    seconds: float
    def __init__(self, policy_version: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class JoinWeightGroupRequest(_message.Message):
    __slots__ = ("epoch", "host", "port", "rank", "world_size", "timeout_s", "backend")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    host: str
    port: int
    rank: int
    world_size: int
    timeout_s: float
    backend: str
    def __init__(self, epoch: _Optional[int] = ..., host: _Optional[str] = ..., port: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., timeout_s: _Optional[float] = ..., backend: _Optional[str] = ...) -> None: ...

class JoinWeightGroupResponse(_message.Message):
    __slots__ = ("epoch", "rank")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    rank: int
    def __init__(self, epoch: _Optional[int] = ..., rank: _Optional[int] = ...) -> None: ...

class ReceiveWeightsRequest(_message.Message):
    __slots__ = ("epoch", "version")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    version: int
    def __init__(self, epoch: _Optional[int] = ..., version: _Optional[int] = ...) -> None: ...

class GetRolloutStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetRolloutStatusResponse(_message.Message):
    __slots__ = ("worker_id", "engine", "model", "policy_version", "active_requests", "tokens_generated")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    engine: str
    model: str
    policy_version: int
    active_requests: int
    tokens_generated: int
    def __init__(self, worker_id: _Optional[str] = ..., engine: _Optional[str] = ..., model: _Optional[str] = ..., policy_version: _Optional[int] = ..., active_requests: _Optional[int] = ..., tokens_generated: _Optional[int] = ...) -> None: ...

class FetchWeightsRequest(_message.Message):
    __slots__ = ("version", "offset", "serving_sha256")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SERVING_SHA256_FIELD_NUMBER: _ClassVar[int]
    version: int
    offset: int
    serving_sha256: str
    def __init__(self, version: _Optional[int] = ..., offset: _Optional[int] = ..., serving_sha256: _Optional[str] = ...) -> None: ...

class FetchWeightsChunk(_message.Message):
    __slots__ = ("header", "offset", "data", "sha256")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    header: WeightsHeader
    offset: int
    data: bytes
    sha256: str
    def __init__(self, header: _Optional[_Union[WeightsHeader, _Mapping]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., sha256: _Optional[str] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("token_ids", "logprobs", "policy_versions", "forced", "reward", "finish_reason", "parse_failed", "environment", "turns", "tool_calls", "tool_errors", "routed_experts", "teacher_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    FORCED_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PARSE_FAILED_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_ERRORS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    TEACHER_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    policy_versions: _containers.RepeatedScalarFieldContainer[int]
    forced: _containers.RepeatedScalarFieldContainer[bool]
    reward: float
    finish_reason: FinishReason
    parse_failed: bool
    environment: _containers.RepeatedScalarFieldContainer[bool]
    turns: int
    tool_calls: int
    tool_errors: int
    routed_experts: RoutedExperts
    teacher_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., policy_versions: _Optional[_Iterable[int]] = ..., forced: _Optional[_Iterable[bool]] = ..., reward: _Optional[float] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., parse_failed: _Optional[bool] = ..., environment: _Optional[_Iterable[bool]] = ..., turns: _Optional[int] = ..., tool_calls: _Optional[int] = ..., tool_errors: _Optional[int] = ..., routed_experts: _Optional[_Union[RoutedExperts, _Mapping]] = ..., teacher_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class RoutedExperts(_message.Message):
    __slots__ = ("indices", "layers", "top_k", "wide")
    INDICES_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    WIDE_FIELD_NUMBER: _ClassVar[int]
    indices: bytes
    layers: int
    top_k: int
    wide: bool
    def __init__(self, indices: _Optional[bytes] = ..., layers: _Optional[int] = ..., top_k: _Optional[int] = ..., wide: _Optional[bool] = ...) -> None: ...

class RolloutGroup(_message.Message):
    __slots__ = ("group_id", "prompt_id", "prompt_token_ids", "samples", "min_policy_version", "max_policy_version", "worker_id", "created_unix_s")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    MIN_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    prompt_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    samples: _containers.RepeatedCompositeFieldContainer[Sample]
    min_policy_version: int
    max_policy_version: int
    worker_id: str
    created_unix_s: float
    def __init__(self, group_id: _Optional[str] = ..., prompt_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., samples: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ..., min_policy_version: _Optional[int] = ..., max_policy_version: _Optional[int] = ..., worker_id: _Optional[str] = ..., created_unix_s: _Optional[float] = ...) -> None: ...

class ScoredSequence(_message.Message):
    __slots__ = ("prompt_ids", "completion_ids")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_IDS_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    completion_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, prompt_ids: _Optional[_Iterable[int]] = ..., completion_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ScoreTokensRequest(_message.Message):
    __slots__ = ("sequences",)
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[ScoredSequence]
    def __init__(self, sequences: _Optional[_Iterable[_Union[ScoredSequence, _Mapping]]] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("logprobs",)
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class ScoreTokensResponse(_message.Message):
    __slots__ = ("sequences", "tokens")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    tokens: int
    def __init__(self, sequences: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., tokens: _Optional[int] = ...) -> None: ...
