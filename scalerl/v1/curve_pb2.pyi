from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CurvePoint(_message.Message):
    __slots__ = ("compute", "reward")
    COMPUTE_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    compute: float
    reward: float
    def __init__(self, compute: _Optional[float] = ..., reward: _Optional[float] = ...) -> None: ...

class CurveParams(_message.Message):
    __slots__ = ("a", "b", "c_mid", "r0")
    A_FIELD_NUMBER: _ClassVar[int]
    B_FIELD_NUMBER: _ClassVar[int]
    C_MID_FIELD_NUMBER: _ClassVar[int]
    R0_FIELD_NUMBER: _ClassVar[int]
    a: float
    b: float
    c_mid: float
    r0: float
    def __init__(self, a: _Optional[float] = ..., b: _Optional[float] = ..., c_mid: _Optional[float] = ..., r0: _Optional[float] = ...) -> None: ...

class FitRequest(_message.Message):
    __slots__ = ("points", "r0", "min_compute", "max_compute")
    POINTS_FIELD_NUMBER: _ClassVar[int]
    R0_FIELD_NUMBER: _ClassVar[int]
    MIN_COMPUTE_FIELD_NUMBER: _ClassVar[int]
    MAX_COMPUTE_FIELD_NUMBER: _ClassVar[int]
    points: _containers.RepeatedCompositeFieldContainer[CurvePoint]
    r0: float
    min_compute: float
    max_compute: float
    def __init__(self, points: _Optional[_Iterable[_Union[CurvePoint, _Mapping]]] = ..., r0: _Optional[float] = ..., min_compute: _Optional[float] = ..., max_compute: _Optional[float] = ...) -> None: ...

class FitResponse(_message.Message):
    __slots__ = ("params", "sse", "points_used", "warnings")
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    SSE_FIELD_NUMBER: _ClassVar[int]
    POINTS_USED_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    params: CurveParams
    sse: float
    points_used: int
    warnings: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, params: _Optional[_Union[CurveParams, _Mapping]] = ..., sse: _Optional[float] = ..., points_used: _Optional[int] = ..., warnings: _Optional[_Iterable[str]] = ...) -> None: ...

class Prediction(_message.Message):
    __slots__ = ("compute", "reward", "lower", "upper")
    COMPUTE_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    LOWER_FIELD_NUMBER: _ClassVar[int]
    UPPER_FIELD_NUMBER: _ClassVar[int]
    compute: float
    reward: float
    lower: float
    upper: float
    def __init__(self, compute: _Optional[float] = ..., reward: _Optional[float] = ..., lower: _Optional[float] = ..., upper: _Optional[float] = ...) -> None: ...

class ExtrapolateRequest(_message.Message):
    __slots__ = ("params", "run_id", "compute")
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_FIELD_NUMBER: _ClassVar[int]
    params: CurveParams
    run_id: str
    compute: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, params: _Optional[_Union[CurveParams, _Mapping]] = ..., run_id: _Optional[str] = ..., compute: _Optional[_Iterable[float]] = ...) -> None: ...

class ExtrapolateResponse(_message.Message):
    __slots__ = ("predictions",)
    PREDICTIONS_FIELD_NUMBER: _ClassVar[int]
    predictions: _containers.RepeatedCompositeFieldContainer[Prediction]
    def __init__(self, predictions: _Optional[_Iterable[_Union[Prediction, _Mapping]]] = ...) -> None: ...

class RecordPointRequest(_message.Message):
    __slots__ = ("run_id", "point", "r0")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    POINT_FIELD_NUMBER: _ClassVar[int]
    R0_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    point: CurvePoint
    r0: float
    def __init__(self, run_id: _Optional[str] = ..., point: _Optional[_Union[CurvePoint, _Mapping]] = ..., r0: _Optional[float] = ...) -> None: ...

class RecordPointResponse(_message.Message):
    __slots__ = ("points", "fit")
    POINTS_FIELD_NUMBER: _ClassVar[int]
    FIT_FIELD_NUMBER: _ClassVar[int]
    points: int
    fit: FitResponse
    def __init__(self, points: _Optional[int] = ..., fit: _Optional[_Union[FitResponse, _Mapping]] = ...) -> None: ...

class GetRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class GetRunResponse(_message.Message):
    __slots__ = ("run_id", "points", "fit")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    POINTS_FIELD_NUMBER: _ClassVar[int]
    FIT_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    points: _containers.RepeatedCompositeFieldContainer[CurvePoint]
    fit: FitResponse
    def __init__(self, run_id: _Optional[str] = ..., points: _Optional[_Iterable[_Union[CurvePoint, _Mapping]]] = ..., fit: _Optional[_Union[FitResponse, _Mapping]] = ...) -> None: ...
