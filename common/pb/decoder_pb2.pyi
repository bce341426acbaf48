from . import common_pb2 as _common_pb2
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
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "min_tokens")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    min_tokens: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., min_tokens: _Optional[int] = ...) -> None: ...

class ContentPart(_message.Message):
    __slots__ = ("text", "image", "video")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    VIDEO_FIELD_NUMBER: _ClassVar[int]
    text: str
    image: _common_pb2.ImageInput
    video: _common_pb2.VideoInput
    def __init__(self, text: _Optional[str] = ..., image: _Optional[_Union[_common_pb2.ImageInput, _Mapping]] = ..., video: _Optional[_Union[_common_pb2.VideoInput, _Mapping]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: _containers.RepeatedCompositeFieldContainer[ContentPart]
    def __init__(self, role: _Optional[str] = ..., content: _Optional[_Iterable[_Union[ContentPart, _Mapping]]] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "chat", "prompt_token_ids", "images", "sampling", "cache_salt", "videos", "lora_adapter", "n")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    VIDEOS_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTER_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    chat: ChatMessages
    prompt_token_ids: TokenIds
    images: _containers.RepeatedCompositeFieldContainer[_common_pb2.ImageInput]
    sampling: SamplingParams
    cache_salt: str
    videos: _containers.RepeatedCompositeFieldContainer[_common_pb2.VideoInput]
    lora_adapter: str
    n: int
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., prompt_token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., images: _Optional[_Iterable[_Union[_common_pb2.ImageInput, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., videos: _Optional[_Iterable[_Union[_common_pb2.VideoInput, _Mapping]]] = ..., lora_adapter: _Optional[str] = ..., n: _Optional[int] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("logprob", "top_ids", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprob: _Optional[float] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens", "images", "images_encoder_cache_hits", "images_skipped_by_kv_reuse")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    IMAGES_ENCODER_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_SKIPPED_BY_KV_REUSE_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    images: int
    images_encoder_cache_hits: int
    images_skipped_by_kv_reuse: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., images: _Optional[int] = ..., images_encoder_cache_hits: _Optional[int] = ..., images_skipped_by_kv_reuse: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "text", "logprobs", "finish_reason", "usage", "index")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    finish_reason: FinishReason
    usage: Usage
    index: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., index: _Optional[int] = ...) -> None: ...

class DecoderStats(_message.Message):
    __slots__ = ("running", "waiting", "kv_blocks_used", "kv_blocks_total", "prefix_cache_queried_tokens", "prefix_cache_hit_tokens", "images_encoded", "images_encoder_cache_hits", "images_skipped_by_kv_reuse", "preemptions", "requests_finished", "requests_aborted", "active_leases", "images_prefetched", "lookahead_ready_at_prefill", "kv_blocks_cached_free", "lookahead_waited_at_prefill", "requests_failed", "embedding_transports", "lookahead_boosted", "ttft_stage_seconds", "ttft_calls", "prefix_cache_hit_tokens_by_adapter", "kv_groups", "samples_forked", "samples_queued", "embeddings_retained_hits", "embeddings_retained_bytes", "embeddings_retained_evictions")
    class EmbeddingTransportsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class TtftStageSecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class PrefixCacheHitTokensByAdapterEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_ENCODED_FIELD_NUMBER: _ClassVar[int]
    IMAGES_ENCODER_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_SKIPPED_BY_KV_REUSE_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FINISHED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_ABORTED_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    IMAGES_PREFETCHED_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_READY_AT_PREFILL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_CACHED_FREE_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_WAITED_AT_PREFILL_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FAILED_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_BOOSTED_FIELD_NUMBER: _ClassVar[int]
    TTFT_STAGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TTFT_CALLS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_TOKENS_BY_ADAPTER_FIELD_NUMBER: _ClassVar[int]
    KV_GROUPS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FORKED_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_QUEUED_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_RETAINED_HITS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_RETAINED_BYTES_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_RETAINED_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    images_encoded: int
    images_encoder_cache_hits: int
    images_skipped_by_kv_reuse: int
    preemptions: int
    requests_finished: int
    requests_aborted: int
    active_leases: int
    images_prefetched: int
    lookahead_ready_at_prefill: int
    kv_blocks_cached_free: int
    lookahead_waited_at_prefill: int
    requests_failed: int
    embedding_transports: _containers.ScalarMap[str, int]
    lookahead_boosted: int
    ttft_stage_seconds: _containers.ScalarMap[str, float]
    ttft_calls: int
    prefix_cache_hit_tokens_by_adapter: _containers.ScalarMap[str, int]
    kv_groups: _containers.RepeatedCompositeFieldContainer[KvGroupStats]
    samples_forked: int
    samples_queued: int
    embeddings_retained_hits: int
    embeddings_retained_bytes: int
    embeddings_retained_evictions: int
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., prefix_cache_queried_tokens: _Optional[int] = ..., prefix_cache_hit_tokens: _Optional[int] = ..., images_encoded: _Optional[int] = ..., images_encoder_cache_hits: _Optional[int] = ..., images_skipped_by_kv_reuse: _Optional[int] = ..., preemptions: _Optional[int] = ..., requests_finished: _Optional[int] = ..., requests_aborted: _Optional[int] = ..., active_leases: _Optional[int] = ..., images_prefetched: _Optional[int] = ..., lookahead_ready_at_prefill: _Optional[int] = ..., kv_blocks_cached_free: _Optional[int] = ..., lookahead_waited_at_prefill: _Optional[int] = ..., requests_failed: _Optional[int] = ..., embedding_transports: _Optional[_Mapping[str, int]] = ..., lookahead_boosted: _Optional[int] = ..., ttft_stage_seconds: _Optional[_Mapping[str, float]] = ..., ttft_calls: _Optional[int] = ..., prefix_cache_hit_tokens_by_adapter: _Optional[_Mapping[str, int]] = ..., kv_groups: _Optional[_Iterable[_Union[KvGroupStats, _Mapping]]] = ..., samples_forked: _Optional[int] = ..., samples_queued: _Optional[int] = ..., embeddings_retained_hits: _Optional[int] = ..., embeddings_retained_bytes: _Optional[int] = ..., embeddings_retained_evictions: _Optional[int] = ...) -> None: ...

class KvGroupStats(_message.Message):
    __slots__ = ("name", "window", "blocks_used", "blocks_total", "blocks_cached_free")
    NAME_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_CACHED_FREE_FIELD_NUMBER: _ClassVar[int]
    name: str
    window: int
    blocks_used: int
    blocks_total: int
    blocks_cached_free: int
    def __init__(self, name: _Optional[str] = ..., window: _Optional[int] = ..., blocks_used: _Optional[int] = ..., blocks_total: _Optional[int] = ..., blocks_cached_free: _Optional[int] = ...) -> None: ...
