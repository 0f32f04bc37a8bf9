from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CurvePoint(_message.Message):
    __slots__ = ("compute", "reward", "series", "stderr", "prompts", "samples")
    COMPUTE_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    SERIES_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    compute: float
    reward: float
    series: str
    stderr: float
    prompts: int
    samples: int
    def __init__(self, compute: _Optional[float] = ..., reward: _Optional[float] = ..., series: _Optional[str] = ..., stderr: _Optional[float] = ..., prompts: _Optional[int] = ..., samples: _Optional[int] = ...) -> None: ...

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
    __slots__ = ("points", "r0", "min_compute", "max_compute", "method", "predict_compute", "run_id", "task", "target_compute")
    POINTS_FIELD_NUMBER: _ClassVar[int]
    R0_FIELD_NUMBER: _ClassVar[int]
    MIN_COMPUTE_FIELD_NUMBER: _ClassVar[int]
    MAX_COMPUTE_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    PREDICT_COMPUTE_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    TARGET_COMPUTE_FIELD_NUMBER: _ClassVar[int]
    points: _containers.RepeatedCompositeFieldContainer[CurvePoint]
    r0: float
    min_compute: float
    max_compute: float
    method: FitMethod
    predict_compute: _containers.RepeatedScalarFieldContainer[float]
    run_id: str
    task: str
    target_compute: float
    def __init__(self, points: _Optional[_Iterable[_Union[CurvePoint, _Mapping]]] = ..., r0: _Optional[float] = ..., min_compute: _Optional[float] = ..., max_compute: _Optional[float] = ..., method: _Optional[_Union[FitMethod, _Mapping]] = ..., predict_compute: _Optional[_Iterable[float]] = ..., run_id: _Optional[str] = ..., task: _Optional[str] = ..., target_compute: _Optional[float] = ...) -> None: ...

class FitMethod(_message.Message):
    __slots__ = ("bootstrap_resamples", "seed", "level", "paper_grid", "power_law", "seed_sd", "band")
    BOOTSTRAP_RESAMPLES_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    PAPER_GRID_FIELD_NUMBER: _ClassVar[int]
    POWER_LAW_FIELD_NUMBER: _ClassVar[int]
    SEED_SD_FIELD_NUMBER: _ClassVar[int]
    BAND_FIELD_NUMBER: _ClassVar[int]
    bootstrap_resamples: int
    seed: int
    level: float
    paper_grid: bool
    power_law: bool
    seed_sd: float
    band: str
    def __init__(self, bootstrap_resamples: _Optional[int] = ..., seed: _Optional[int] = ..., level: _Optional[float] = ..., paper_grid: _Optional[bool] = ..., power_law: _Optional[bool] = ..., seed_sd: _Optional[float] = ..., band: _Optional[str] = ...) -> None: ...

class Interval(_message.Message):
    __slots__ = ("lower", "upper")
    LOWER_FIELD_NUMBER: _ClassVar[int]
    UPPER_FIELD_NUMBER: _ClassVar[int]
    lower: float
    upper: float
    def __init__(self, lower: _Optional[float] = ..., upper: _Optional[float] = ...) -> None: ...

class ParamIntervals(_message.Message):
    __slots__ = ("a", "b", "c_mid", "level", "resamples")
    A_FIELD_NUMBER: _ClassVar[int]
    B_FIELD_NUMBER: _ClassVar[int]
    C_MID_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    RESAMPLES_FIELD_NUMBER: _ClassVar[int]
    a: Interval
    b: Interval
    c_mid: Interval
    level: float
    resamples: int
    def __init__(self, a: _Optional[_Union[Interval, _Mapping]] = ..., b: _Optional[_Union[Interval, _Mapping]] = ..., c_mid: _Optional[_Union[Interval, _Mapping]] = ..., level: _Optional[float] = ..., resamples: _Optional[int] = ...) -> None: ...

class FitGrid(_message.Message):
    __slots__ = ("a_min", "a_max", "a_step", "c_mid_min", "c_mid_max", "c_mid_count", "description")
    A_MIN_FIELD_NUMBER: _ClassVar[int]
    A_MAX_FIELD_NUMBER: _ClassVar[int]
    A_STEP_FIELD_NUMBER: _ClassVar[int]
    C_MID_MIN_FIELD_NUMBER: _ClassVar[int]
    C_MID_MAX_FIELD_NUMBER: _ClassVar[int]
    C_MID_COUNT_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    a_min: float
    a_max: float
    a_step: float
    c_mid_min: float
    c_mid_max: float
    c_mid_count: int
    description: str
    def __init__(self, a_min: _Optional[float] = ..., a_max: _Optional[float] = ..., a_step: _Optional[float] = ..., c_mid_min: _Optional[float] = ..., c_mid_max: _Optional[float] = ..., c_mid_count: _Optional[int] = ..., description: _Optional[str] = ...) -> None: ...

class PowerLawFit(_message.Message):
    __slots__ = ("a", "d", "b", "sse")
    A_FIELD_NUMBER: _ClassVar[int]
    D_FIELD_NUMBER: _ClassVar[int]
    B_FIELD_NUMBER: _ClassVar[int]
    SSE_FIELD_NUMBER: _ClassVar[int]
    a: float
    d: float
    b: float
    sse: float
    def __init__(self, a: _Optional[float] = ..., d: _Optional[float] = ..., b: _Optional[float] = ..., sse: _Optional[float] = ...) -> None: ...

class FitResponse(_message.Message):
    __slots__ = ("params", "sse", "points_used", "warnings", "intervals", "grid", "predictions", "power_law", "power_law_predictions", "stability")
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    SSE_FIELD_NUMBER: _ClassVar[int]
    POINTS_USED_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    INTERVALS_FIELD_NUMBER: _ClassVar[int]
    GRID_FIELD_NUMBER: _ClassVar[int]
    PREDICTIONS_FIELD_NUMBER: _ClassVar[int]
    POWER_LAW_FIELD_NUMBER: _ClassVar[int]
    POWER_LAW_PREDICTIONS_FIELD_NUMBER: _ClassVar[int]
    STABILITY_FIELD_NUMBER: _ClassVar[int]
    params: CurveParams
    sse: float
    points_used: int
    warnings: _containers.RepeatedScalarFieldContainer[str]
    intervals: ParamIntervals
    grid: FitGrid
    predictions: _containers.RepeatedCompositeFieldContainer[Prediction]
    power_law: PowerLawFit
    power_law_predictions: _containers.RepeatedCompositeFieldContainer[Prediction]
    stability: Stability
    def __init__(self, params: _Optional[_Union[CurveParams, _Mapping]] = ..., sse: _Optional[float] = ..., points_used: _Optional[int] = ..., warnings: _Optional[_Iterable[str]] = ..., intervals: _Optional[_Union[ParamIntervals, _Mapping]] = ..., grid: _Optional[_Union[FitGrid, _Mapping]] = ..., predictions: _Optional[_Iterable[_Union[Prediction, _Mapping]]] = ..., power_law: _Optional[_Union[PowerLawFit, _Mapping]] = ..., power_law_predictions: _Optional[_Iterable[_Union[Prediction, _Mapping]]] = ..., stability: _Optional[_Union[Stability, _Mapping]] = ...) -> None: ...

class Stability(_message.Message):
    __slots__ = ("target_compute", "history", "moved", "band_half_width", "ratio", "verdict", "summary")
    TARGET_COMPUTE_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    MOVED_FIELD_NUMBER: _ClassVar[int]
    BAND_HALF_WIDTH_FIELD_NUMBER: _ClassVar[int]
    RATIO_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    target_compute: float
    history: _containers.RepeatedCompositeFieldContainer[Prediction]
    moved: float
    band_half_width: float
    ratio: float
    verdict: str
    summary: str
    def __init__(self, target_compute: _Optional[float] = ..., history: _Optional[_Iterable[_Union[Prediction, _Mapping]]] = ..., moved: _Optional[float] = ..., band_half_width: _Optional[float] = ..., ratio: _Optional[float] = ..., verdict: _Optional[str] = ..., summary: _Optional[str] = ...) -> None: ...

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
    __slots__ = ("params", "run_id", "compute", "task")
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    params: CurveParams
    run_id: str
    compute: _containers.RepeatedScalarFieldContainer[float]
    task: str
    def __init__(self, params: _Optional[_Union[CurveParams, _Mapping]] = ..., run_id: _Optional[str] = ..., compute: _Optional[_Iterable[float]] = ..., task: _Optional[str] = ...) -> None: ...

class ExtrapolateResponse(_message.Message):
    __slots__ = ("predictions",)
    PREDICTIONS_FIELD_NUMBER: _ClassVar[int]
    predictions: _containers.RepeatedCompositeFieldContainer[Prediction]
    def __init__(self, predictions: _Optional[_Iterable[_Union[Prediction, _Mapping]]] = ...) -> None: ...

class RecordPointRequest(_message.Message):
    __slots__ = ("run_id", "point", "r0", "task")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    POINT_FIELD_NUMBER: _ClassVar[int]
    R0_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    point: CurvePoint
    r0: float
    task: str
    def __init__(self, run_id: _Optional[str] = ..., point: _Optional[_Union[CurvePoint, _Mapping]] = ..., r0: _Optional[float] = ..., task: _Optional[str] = ...) -> None: ...

class RecordPointResponse(_message.Message):
    __slots__ = ("points", "fit")
    POINTS_FIELD_NUMBER: _ClassVar[int]
    FIT_FIELD_NUMBER: _ClassVar[int]
    points: int
    fit: FitResponse
    def __init__(self, points: _Optional[int] = ..., fit: _Optional[_Union[FitResponse, _Mapping]] = ...) -> None: ...

class TrimRunRequest(_message.Message):
    __slots__ = ("run_id", "max_compute")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_COMPUTE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    max_compute: float
    def __init__(self, run_id: _Optional[str] = ..., max_compute: _Optional[float] = ...) -> None: ...

class TrimRunResponse(_message.Message):
    __slots__ = ("points_removed", "points", "fit")
    POINTS_REMOVED_FIELD_NUMBER: _ClassVar[int]
    POINTS_FIELD_NUMBER: _ClassVar[int]
    FIT_FIELD_NUMBER: _ClassVar[int]
    points_removed: int
    points: int
    fit: FitResponse
    def __init__(self, points_removed: _Optional[int] = ..., points: _Optional[int] = ..., fit: _Optional[_Union[FitResponse, _Mapping]] = ...) -> None: ...

class GetRunRequest(_message.Message):
    __slots__ = ("run_id", "task")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    task: str
    def __init__(self, run_id: _Optional[str] = ..., task: _Optional[str] = ...) -> None: ...

class GetRunResponse(_message.Message):
    __slots__ = ("run_id", "points", "fit", "task", "tasks")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    POINTS_FIELD_NUMBER: _ClassVar[int]
    FIT_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    points: _containers.RepeatedCompositeFieldContainer[CurvePoint]
    fit: FitResponse
    task: str
    tasks: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, run_id: _Optional[str] = ..., points: _Optional[_Iterable[_Union[CurvePoint, _Mapping]]] = ..., fit: _Optional[_Union[FitResponse, _Mapping]] = ..., task: _Optional[str] = ..., tasks: _Optional[_Iterable[str]] = ...) -> None: ...

class CompareRunsRequest(_message.Message):
    __slots__ = ("runs", "a_margin", "at_compute")
    RUNS_FIELD_NUMBER: _ClassVar[int]
    A_MARGIN_FIELD_NUMBER: _ClassVar[int]
    AT_COMPUTE_FIELD_NUMBER: _ClassVar[int]
    runs: _containers.RepeatedCompositeFieldContainer[FitRequest]
    a_margin: float
    at_compute: float
    def __init__(self, runs: _Optional[_Iterable[_Union[FitRequest, _Mapping]]] = ..., a_margin: _Optional[float] = ..., at_compute: _Optional[float] = ...) -> None: ...

class RunComparison(_message.Message):
    __slots__ = ("index", "fit", "rank", "b_at_shared_a", "c_mid_at_shared_a", "p_best_a", "p_best_b", "reward_at_compute", "p_best_at_compute")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    FIT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    B_AT_SHARED_A_FIELD_NUMBER: _ClassVar[int]
    C_MID_AT_SHARED_A_FIELD_NUMBER: _ClassVar[int]
    P_BEST_A_FIELD_NUMBER: _ClassVar[int]
    P_BEST_B_FIELD_NUMBER: _ClassVar[int]
    REWARD_AT_COMPUTE_FIELD_NUMBER: _ClassVar[int]
    P_BEST_AT_COMPUTE_FIELD_NUMBER: _ClassVar[int]
    index: int
    fit: FitResponse
    rank: int
    b_at_shared_a: float
    c_mid_at_shared_a: float
    p_best_a: float
    p_best_b: float
    reward_at_compute: float
    p_best_at_compute: float
    def __init__(self, index: _Optional[int] = ..., fit: _Optional[_Union[FitResponse, _Mapping]] = ..., rank: _Optional[int] = ..., b_at_shared_a: _Optional[float] = ..., c_mid_at_shared_a: _Optional[float] = ..., p_best_a: _Optional[float] = ..., p_best_b: _Optional[float] = ..., reward_at_compute: _Optional[float] = ..., p_best_at_compute: _Optional[float] = ...) -> None: ...

class CompareRunsResponse(_message.Message):
    __slots__ = ("runs", "best", "decided_by", "shared_a", "summary", "verdict_stable_from_compute", "early_verdict", "best_at_compute", "at_compute_stable_from_compute", "at_compute_verdict")
    RUNS_FIELD_NUMBER: _ClassVar[int]
    BEST_FIELD_NUMBER: _ClassVar[int]
    DECIDED_BY_FIELD_NUMBER: _ClassVar[int]
    SHARED_A_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    VERDICT_STABLE_FROM_COMPUTE_FIELD_NUMBER: _ClassVar[int]
    EARLY_VERDICT_FIELD_NUMBER: _ClassVar[int]
    BEST_AT_COMPUTE_FIELD_NUMBER: _ClassVar[int]
    AT_COMPUTE_STABLE_FROM_COMPUTE_FIELD_NUMBER: _ClassVar[int]
    AT_COMPUTE_VERDICT_FIELD_NUMBER: _ClassVar[int]
    runs: _containers.RepeatedCompositeFieldContainer[RunComparison]
    best: int
    decided_by: str
    shared_a: float
    summary: str
    verdict_stable_from_compute: float
    early_verdict: str
    best_at_compute: int
    at_compute_stable_from_compute: float
    at_compute_verdict: str
    def __init__(self, runs: _Optional[_Iterable[_Union[RunComparison, _Mapping]]] = ..., best: _Optional[int] = ..., decided_by: _Optional[str] = ..., shared_a: _Optional[float] = ..., summary: _Optional[str] = ..., verdict_stable_from_compute: _Optional[float] = ..., early_verdict: _Optional[str] = ..., best_at_compute: _Optional[int] = ..., at_compute_stable_from_compute: _Optional[float] = ..., at_compute_verdict: _Optional[str] = ...) -> None: ...

class CalibrationRequest(_message.Message):
    __slots__ = ("run_ids", "task", "horizons")
    RUN_IDS_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    HORIZONS_FIELD_NUMBER: _ClassVar[int]
    run_ids: _containers.RepeatedScalarFieldContainer[str]
    task: str
    horizons: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, run_ids: _Optional[_Iterable[str]] = ..., task: _Optional[str] = ..., horizons: _Optional[_Iterable[float]] = ...) -> None: ...

class CalibrationRow(_message.Message):
    __slots__ = ("level", "method", "bias", "horizon_low", "horizon_high", "graded", "coverage", "mean_width", "mae")
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    BIAS_FIELD_NUMBER: _ClassVar[int]
    HORIZON_LOW_FIELD_NUMBER: _ClassVar[int]
    HORIZON_HIGH_FIELD_NUMBER: _ClassVar[int]
    GRADED_FIELD_NUMBER: _ClassVar[int]
    COVERAGE_FIELD_NUMBER: _ClassVar[int]
    MEAN_WIDTH_FIELD_NUMBER: _ClassVar[int]
    MAE_FIELD_NUMBER: _ClassVar[int]
    level: float
    method: str
    bias: float
    horizon_low: float
    horizon_high: float
    graded: int
    coverage: float
    mean_width: float
    mae: float
    def __init__(self, level: _Optional[float] = ..., method: _Optional[str] = ..., bias: _Optional[float] = ..., horizon_low: _Optional[float] = ..., horizon_high: _Optional[float] = ..., graded: _Optional[int] = ..., coverage: _Optional[float] = ..., mean_width: _Optional[float] = ..., mae: _Optional[float] = ...) -> None: ...

class CalibrationResponse(_message.Message):
    __slots__ = ("rows", "overall", "graded", "pending", "run_ids")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    OVERALL_FIELD_NUMBER: _ClassVar[int]
    GRADED_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    RUN_IDS_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedCompositeFieldContainer[CalibrationRow]
    overall: _containers.RepeatedCompositeFieldContainer[CalibrationRow]
    graded: int
    pending: int
    run_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, rows: _Optional[_Iterable[_Union[CalibrationRow, _Mapping]]] = ..., overall: _Optional[_Iterable[_Union[CalibrationRow, _Mapping]]] = ..., graded: _Optional[int] = ..., pending: _Optional[int] = ..., run_ids: _Optional[_Iterable[str]] = ...) -> None: ...
