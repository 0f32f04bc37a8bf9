from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SandboxKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SANDBOX_KIND_UNSPECIFIED: _ClassVar[SandboxKind]
    SANDBOX_KIND_VALUES: _ClassVar[SandboxKind]
    SANDBOX_KIND_STDIO: _ClassVar[SandboxKind]
SANDBOX_KIND_UNSPECIFIED: SandboxKind
SANDBOX_KIND_VALUES: SandboxKind
SANDBOX_KIND_STDIO: SandboxKind

class ExecuteRequest(_message.Message):
    __slots__ = ("code", "kind", "cases", "wall_s")
    CODE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    CASES_FIELD_NUMBER: _ClassVar[int]
    WALL_S_FIELD_NUMBER: _ClassVar[int]
    code: str
    kind: SandboxKind
    cases: _containers.RepeatedScalarFieldContainer[str]
    wall_s: float
    def __init__(self, code: _Optional[str] = ..., kind: _Optional[_Union[SandboxKind, str]] = ..., cases: _Optional[_Iterable[str]] = ..., wall_s: _Optional[float] = ...) -> None: ...

class CaseClaim(_message.Message):
    __slots__ = ("index", "value", "stdout", "error")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    index: int
    value: str
    stdout: str
    error: str
    def __init__(self, index: _Optional[int] = ..., value: _Optional[str] = ..., stdout: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class Containment(_message.Message):
    __slots__ = ("missing", "notes", "uid")
    MISSING_FIELD_NUMBER: _ClassVar[int]
    NOTES_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    missing: _containers.RepeatedScalarFieldContainer[str]
    notes: _containers.RepeatedScalarFieldContainer[str]
    uid: int
    def __init__(self, missing: _Optional[_Iterable[str]] = ..., notes: _Optional[_Iterable[str]] = ..., uid: _Optional[int] = ...) -> None: ...

class ExecuteResponse(_message.Message):
    __slots__ = ("claims", "syntax_error", "stopped", "containment", "seconds")
    CLAIMS_FIELD_NUMBER: _ClassVar[int]
    SYNTAX_ERROR_FIELD_NUMBER: _ClassVar[int]
    STOPPED_FIELD_NUMBER: _ClassVar[int]
    CONTAINMENT_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    claims: _containers.RepeatedCompositeFieldContainer[CaseClaim]
    syntax_error: str
    stopped: str
    containment: Containment
    seconds: float
    def __init__(self, claims: _Optional[_Iterable[_Union[CaseClaim, _Mapping]]] = ..., syntax_error: _Optional[str] = ..., stopped: _Optional[str] = ..., containment: _Optional[_Union[Containment, _Mapping]] = ..., seconds: _Optional[float] = ...) -> None: ...
