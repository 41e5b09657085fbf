from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WeightHeader(_message.Message):
    __slots__ = ("version", "total_bytes", "num_chunks", "checksum", "fencing_token", "sender_id", "format", "tensors", "base_version", "base_checksum", "relay", "signature")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SENDER_ID_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    BASE_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    version: int
    total_bytes: int
    num_chunks: int
    checksum: str
    fencing_token: int
    sender_id: str
    format: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    base_version: int
    base_checksum: str
    relay: _containers.RepeatedCompositeFieldContainer[RelayNode]
    signature: bytes
    def __init__(self, version: _Optional[int] = ..., total_bytes: _Optional[int] = ..., num_chunks: _Optional[int] = ..., checksum: _Optional[str] = ..., fencing_token: _Optional[int] = ..., sender_id: _Optional[str] = ..., format: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., base_version: _Optional[int] = ..., base_checksum: _Optional[str] = ..., relay: _Optional[_Iterable[_Union[RelayNode, _Mapping]]] = ..., signature: _Optional[bytes] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class RelayNode(_message.Message):
    __slots__ = ("addr", "children")
    ADDR_FIELD_NUMBER: _ClassVar[int]
    CHILDREN_FIELD_NUMBER: _ClassVar[int]
    addr: str
    children: _containers.RepeatedCompositeFieldContainer[RelayNode]
    def __init__(self, addr: _Optional[str] = ..., children: _Optional[_Iterable[_Union[RelayNode, _Mapping]]] = ...) -> None: ...

class WeightChunk(_message.Message):
    __slots__ = ("header", "index", "data", "tensor", "offset", "count", "indices", "index_bytes", "crc32")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    INDEX_BYTES_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    header: WeightHeader
    index: int
    data: bytes
    tensor: int
    offset: int
    count: int
    indices: bytes
    index_bytes: int
    crc32: int
    def __init__(self, header: _Optional[_Union[WeightHeader, _Mapping]] = ..., index: _Optional[int] = ..., data: _Optional[bytes] = ..., tensor: _Optional[int] = ..., offset: _Optional[int] = ..., count: _Optional[int] = ..., indices: _Optional[bytes] = ..., index_bytes: _Optional[int] = ..., crc32: _Optional[int] = ...) -> None: ...

class PushAck(_message.Message):
    __slots__ = ("accepted", "version", "code", "message", "apply_s", "relayed", "accepts_deltas")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    APPLY_S_FIELD_NUMBER: _ClassVar[int]
    RELAYED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_DELTAS_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    version: int
    code: str
    message: str
    apply_s: float
    relayed: _containers.RepeatedCompositeFieldContainer[RelayResult]
    accepts_deltas: bool
    def __init__(self, accepted: bool = ..., version: _Optional[int] = ..., code: _Optional[str] = ..., message: _Optional[str] = ..., apply_s: _Optional[float] = ..., relayed: _Optional[_Iterable[_Union[RelayResult, _Mapping]]] = ..., accepts_deltas: bool = ...) -> None: ...

class RelayResult(_message.Message):
    __slots__ = ("addr", "accepted", "version", "code", "message", "accepts_deltas")
    ADDR_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_DELTAS_FIELD_NUMBER: _ClassVar[int]
    addr: str
    accepted: bool
    version: int
    code: str
    message: str
    accepts_deltas: bool
    def __init__(self, addr: _Optional[str] = ..., accepted: bool = ..., version: _Optional[int] = ..., code: _Optional[str] = ..., message: _Optional[str] = ..., accepts_deltas: bool = ...) -> None: ...

class VersionRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VersionInfo(_message.Message):
    __slots__ = ("engine_id", "version", "checksum", "torn", "accepts_deltas", "pushes_refused")
    class PushesRefusedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    TORN_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_DELTAS_FIELD_NUMBER: _ClassVar[int]
    PUSHES_REFUSED_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    version: int
    checksum: str
    torn: bool
    accepts_deltas: bool
    pushes_refused: _containers.ScalarMap[str, int]
    def __init__(self, engine_id: _Optional[str] = ..., version: _Optional[int] = ..., checksum: _Optional[str] = ..., torn: bool = ..., accepts_deltas: bool = ..., pushes_refused: _Optional[_Mapping[str, int]] = ...) -> None: ...
