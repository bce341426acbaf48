from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Transport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSPORT_UNSPECIFIED: _ClassVar[Transport]
    TRANSPORT_CUDA_IPC: _ClassVar[Transport]
    TRANSPORT_SHM: _ClassVar[Transport]
    TRANSPORT_INLINE: _ClassVar[Transport]
    TRANSPORT_NIXL: _ClassVar[Transport]

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
TRANSPORT_UNSPECIFIED: Transport
TRANSPORT_CUDA_IPC: Transport
TRANSPORT_SHM: Transport
TRANSPORT_INLINE: Transport
TRANSPORT_NIXL: Transport
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType

class ImageInput(_message.Message):
    __slots__ = ("data", "content_hash", "min_pixels", "max_pixels", "pan_and_scan")
    DATA_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    MIN_PIXELS_FIELD_NUMBER: _ClassVar[int]
    MAX_PIXELS_FIELD_NUMBER: _ClassVar[int]
    PAN_AND_SCAN_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    content_hash: str
    min_pixels: int
    max_pixels: int
    pan_and_scan: bool
    def __init__(self, data: _Optional[bytes] = ..., content_hash: _Optional[str] = ..., min_pixels: _Optional[int] = ..., max_pixels: _Optional[int] = ..., pan_and_scan: _Optional[bool] = ...) -> None: ...

class VideoInput(_message.Message):
    __slots__ = ("data", "content_hash", "fps", "max_frames", "min_pixels", "max_pixels")
    DATA_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    FPS_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAMES_FIELD_NUMBER: _ClassVar[int]
    MIN_PIXELS_FIELD_NUMBER: _ClassVar[int]
    MAX_PIXELS_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    content_hash: str
    fps: float
    max_frames: int
    min_pixels: int
    max_pixels: int
    def __init__(self, data: _Optional[bytes] = ..., content_hash: _Optional[str] = ..., fps: _Optional[float] = ..., max_frames: _Optional[int] = ..., min_pixels: _Optional[int] = ..., max_pixels: _Optional[int] = ...) -> None: ...

class ImageGrid(_message.Message):
    __slots__ = ("thw", "video_timestamps", "second_per_grid")
    THW_FIELD_NUMBER: _ClassVar[int]
    VIDEO_TIMESTAMPS_FIELD_NUMBER: _ClassVar[int]
    SECOND_PER_GRID_FIELD_NUMBER: _ClassVar[int]
    thw: _containers.RepeatedScalarFieldContainer[int]
    video_timestamps: _containers.RepeatedScalarFieldContainer[float]
    second_per_grid: float
    def __init__(self, thw: _Optional[_Iterable[int]] = ..., video_timestamps: _Optional[_Iterable[float]] = ..., second_per_grid: _Optional[float] = ...) -> None: ...

class CudaIpcLocation(_message.Message):
    __slots__ = ("mem_handle", "offset", "device_uuid", "event_handle", "arena_nbytes")
    MEM_HANDLE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    ARENA_NBYTES_FIELD_NUMBER: _ClassVar[int]
    mem_handle: bytes
    offset: int
    device_uuid: str
    event_handle: bytes
    arena_nbytes: int
    def __init__(self, mem_handle: _Optional[bytes] = ..., offset: _Optional[int] = ..., device_uuid: _Optional[str] = ..., event_handle: _Optional[bytes] = ..., arena_nbytes: _Optional[int] = ...) -> None: ...

class ShmLocation(_message.Message):
    __slots__ = ("name", "offset", "arena_nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    ARENA_NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    offset: int
    arena_nbytes: int
    def __init__(self, name: _Optional[str] = ..., offset: _Optional[int] = ..., arena_nbytes: _Optional[int] = ...) -> None: ...

class NixlLocation(_message.Message):
    __slots__ = ("agent_name", "agent_metadata", "address", "offset", "arena_nbytes", "vram", "device_id")
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    ARENA_NBYTES_FIELD_NUMBER: _ClassVar[int]
    VRAM_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    agent_metadata: bytes
    address: int
    offset: int
    arena_nbytes: int
    vram: bool
    device_id: int
    def __init__(self, agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., address: _Optional[int] = ..., offset: _Optional[int] = ..., arena_nbytes: _Optional[int] = ..., vram: _Optional[bool] = ..., device_id: _Optional[int] = ...) -> None: ...

class EmbeddingRef(_message.Message):
    __slots__ = ("content_hash", "shape", "dtype", "nbytes", "cache_hit", "lease_id", "lease_expires_in_s", "cuda_ipc", "shm", "inline_data", "nixl", "grid_thw", "video_timestamps", "second_per_grid")
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    INLINE_DATA_FIELD_NUMBER: _ClassVar[int]
    NIXL_FIELD_NUMBER: _ClassVar[int]
    GRID_THW_FIELD_NUMBER: _ClassVar[int]
    VIDEO_TIMESTAMPS_FIELD_NUMBER: _ClassVar[int]
    SECOND_PER_GRID_FIELD_NUMBER: _ClassVar[int]
    content_hash: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    nbytes: int
    cache_hit: bool
    lease_id: str
    lease_expires_in_s: float
    cuda_ipc: CudaIpcLocation
    shm: ShmLocation
    inline_data: bytes
    nixl: NixlLocation
    grid_thw: _containers.RepeatedScalarFieldContainer[int]
    video_timestamps: _containers.RepeatedScalarFieldContainer[float]
    second_per_grid: float
    def __init__(self, content_hash: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ..., nbytes: _Optional[int] = ..., cache_hit: _Optional[bool] = ..., lease_id: _Optional[str] = ..., lease_expires_in_s: _Optional[float] = ..., cuda_ipc: _Optional[_Union[CudaIpcLocation, _Mapping]] = ..., shm: _Optional[_Union[ShmLocation, _Mapping]] = ..., inline_data: _Optional[bytes] = ..., nixl: _Optional[_Union[NixlLocation, _Mapping]] = ..., grid_thw: _Optional[_Iterable[int]] = ..., video_timestamps: _Optional[_Iterable[float]] = ..., second_per_grid: _Optional[float] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
