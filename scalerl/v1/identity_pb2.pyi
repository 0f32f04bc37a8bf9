from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class HelloRequest(_message.Message):
    __slots__ = ("challenge",)
    CHALLENGE_FIELD_NUMBER: _ClassVar[int]
    challenge: bytes
    def __init__(self, challenge: _Optional[bytes] = ...) -> None: ...

class HelloReply(_message.Message):
    __slots__ = ("service", "address", "instance", "proof")
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    service: str
    address: str
    instance: str
    proof: bytes
    def __init__(self, service: _Optional[str] = ..., address: _Optional[str] = ..., instance: _Optional[str] = ..., proof: _Optional[bytes] = ...) -> None: ...
