from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WeightHeader(_message.Message):
    __slots__ = ("version", "total_bytes", "num_chunks", "checksum", "fencing_token", "sender_id", "format")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SENDER_ID_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    version: int
    total_bytes: int
    num_chunks: int
    checksum: str
    fencing_token: int
    sender_id: str
    format: str
    def __init__(self, version: _Optional[int] = ..., total_bytes: _Optional[int] = ..., num_chunks: _Optional[int] = ..., checksum: _Optional[str] = ..., fencing_token: _Optional[int] = ..., sender_id: _Optional[str] = ..., format: _Optional[str] = ...) -> None: ...

class WeightChunk(_message.Message):
    __slots__ = ("header", "index", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: WeightHeader
    index: int
    data: bytes
    def __init__(self, header: _Optional[_Union[WeightHeader, _Mapping]] = ..., index: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PushAck(_message.Message):
    __slots__ = ("accepted", "version", "code", "message", "apply_s")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    APPLY_S_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    version: int
    code: str
    message: str
    apply_s: float
    def __init__(self, accepted: _Optional[bool] = ..., version: _Optional[int] = ..., code: _Optional[str] = ..., message: _Optional[str] = ..., apply_s: _Optional[float] = ...) -> None: ...

class VersionRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VersionInfo(_message.Message):
    __slots__ = ("engine_id", "version", "checksum")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    version: int
    checksum: str
    def __init__(self, engine_id: _Optional[str] = ..., version: _Optional[int] = ..., checksum: _Optional[str] = ...) -> None: ...
