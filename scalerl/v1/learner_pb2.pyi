from scalerl.v1 import rollout_pb2 as _rollout_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class GetLearnerStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetLearnerStatusResponse(_message.Message):
    __slots__ = ("step", "policy_version", "compute_hours", "queue_depth", "last_metrics", "heldout_pass_rate")
    class LastMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_HOURS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    LAST_METRICS_FIELD_NUMBER: _ClassVar[int]
    HELDOUT_PASS_RATE_FIELD_NUMBER: _ClassVar[int]
    step: int
    policy_version: int
    compute_hours: float
    queue_depth: int
    last_metrics: _containers.ScalarMap[str, float]
    heldout_pass_rate: float
    def __init__(self, step: _Optional[int] = ..., policy_version: _Optional[int] = ..., compute_hours: _Optional[float] = ..., queue_depth: _Optional[int] = ..., last_metrics: _Optional[_Mapping[str, float]] = ..., heldout_pass_rate: _Optional[float] = ...) -> None: ...
