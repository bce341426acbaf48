from . import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EncodeRequest(_message.Message):
    __slots__ = ("request_id", "images", "accept", "cache_salt", "prefetch", "lease_owner", "videos", "nixl_agent", "await_file_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_OWNER_FIELD_NUMBER: _ClassVar[int]
    VIDEOS_FIELD_NUMBER: _ClassVar[int]
    NIXL_AGENT_FIELD_NUMBER: _ClassVar[int]
    AWAIT_FILE_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    images: _containers.RepeatedCompositeFieldContainer[_common_pb2.ImageInput]
    accept: _containers.RepeatedScalarFieldContainer[_common_pb2.Transport]
    cache_salt: str
    prefetch: bool
    lease_owner: str
    videos: _containers.RepeatedCompositeFieldContainer[_common_pb2.VideoInput]
    nixl_agent: str
    await_file_ms: int
    def __init__(self, request_id: _Optional[str] = ..., images: _Optional[_Iterable[_Union[_common_pb2.ImageInput, _Mapping]]] = ..., accept: _Optional[_Iterable[_Union[_common_pb2.Transport, str]]] = ..., cache_salt: _Optional[str] = ..., prefetch: _Optional[bool] = ..., lease_owner: _Optional[str] = ..., videos: _Optional[_Iterable[_Union[_common_pb2.VideoInput, _Mapping]]] = ..., nixl_agent: _Optional[str] = ..., await_file_ms: _Optional[int] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("embeddings",)
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    embeddings: _containers.RepeatedCompositeFieldContainer[_common_pb2.EmbeddingRef]
    def __init__(self, embeddings: _Optional[_Iterable[_Union[_common_pb2.EmbeddingRef, _Mapping]]] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("images", "cache_salt", "videos", "needed_now")
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    VIDEOS_FIELD_NUMBER: _ClassVar[int]
    NEEDED_NOW_FIELD_NUMBER: _ClassVar[int]
    images: _containers.RepeatedCompositeFieldContainer[_common_pb2.ImageInput]
    cache_salt: str
    videos: _containers.RepeatedCompositeFieldContainer[_common_pb2.VideoInput]
    needed_now: bool
    def __init__(self, images: _Optional[_Iterable[_Union[_common_pb2.ImageInput, _Mapping]]] = ..., cache_salt: _Optional[str] = ..., videos: _Optional[_Iterable[_Union[_common_pb2.VideoInput, _Mapping]]] = ..., needed_now: _Optional[bool] = ...) -> None: ...

class PrefetchResponse(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    def __init__(self, accepted: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_ids", "lease_owner", "request_ids")
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_OWNER_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    lease_ids: _containers.RepeatedScalarFieldContainer[str]
    lease_owner: str
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, lease_ids: _Optional[_Iterable[str]] = ..., lease_owner: _Optional[str] = ..., request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("content_hashes", "cache_salt")
    CONTENT_HASHES_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    content_hashes: _containers.RepeatedScalarFieldContainer[str]
    cache_salt: str
    def __init__(self, content_hashes: _Optional[_Iterable[str]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("cached", "grids")
    CACHED_FIELD_NUMBER: _ClassVar[int]
    GRIDS_FIELD_NUMBER: _ClassVar[int]
    cached: _containers.RepeatedScalarFieldContainer[bool]
    grids: _containers.RepeatedCompositeFieldContainer[_common_pb2.ImageGrid]
    def __init__(self, cached: _Optional[_Iterable[bool]] = ..., grids: _Optional[_Iterable[_Union[_common_pb2.ImageGrid, _Mapping]]] = ...) -> None: ...

class EncoderStats(_message.Message):
    __slots__ = ("cache_bytes_used", "cache_bytes_capacity", "entries", "hits", "misses", "evictions", "leased_bytes", "active_leases", "encodes", "images_per_s", "expired_leases", "inflight_dedups", "prefetches", "model_fingerprint", "device", "stage_seconds", "encode_calls", "tower_gpu_seconds", "transports", "device_memory_allocated_bytes", "device_memory_reserved_bytes", "tower_graphs", "tower_thread_seconds", "vision_batches")
    class StageSecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class TowerThreadSecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    CACHE_BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    CACHE_BYTES_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    LEASED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    ENCODES_FIELD_NUMBER: _ClassVar[int]
    IMAGES_PER_S_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_LEASES_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_DEDUPS_FIELD_NUMBER: _ClassVar[int]
    PREFETCHES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    STAGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ENCODE_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOWER_GPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_ALLOCATED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOWER_GRAPHS_FIELD_NUMBER: _ClassVar[int]
    TOWER_THREAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    VISION_BATCHES_FIELD_NUMBER: _ClassVar[int]
    cache_bytes_used: int
    cache_bytes_capacity: int
    entries: int
    hits: int
    misses: int
    evictions: int
    leased_bytes: int
    active_leases: int
    encodes: int
    images_per_s: float
    expired_leases: int
    inflight_dedups: int
    prefetches: int
    model_fingerprint: str
    device: str
    stage_seconds: _containers.ScalarMap[str, float]
    encode_calls: int
    tower_gpu_seconds: float
    transports: str
    device_memory_allocated_bytes: int
    device_memory_reserved_bytes: int
    tower_graphs: int
    tower_thread_seconds: _containers.ScalarMap[str, float]
    vision_batches: int
    def __init__(self, cache_bytes_used: _Optional[int] = ..., cache_bytes_capacity: _Optional[int] = ..., entries: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., leased_bytes: _Optional[int] = ..., active_leases: _Optional[int] = ..., encodes: _Optional[int] = ..., images_per_s: _Optional[float] = ..., expired_leases: _Optional[int] = ..., inflight_dedups: _Optional[int] = ..., prefetches: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., device: _Optional[str] = ..., stage_seconds: _Optional[_Mapping[str, float]] = ..., encode_calls: _Optional[int] = ..., tower_gpu_seconds: _Optional[float] = ..., transports: _Optional[str] = ..., device_memory_allocated_bytes: _Optional[int] = ..., device_memory_reserved_bytes: _Optional[int] = ..., tower_graphs: _Optional[int] = ..., tower_thread_seconds: _Optional[_Mapping[str, float]] = ..., vision_batches: _Optional[int] = ...) -> None: ...
