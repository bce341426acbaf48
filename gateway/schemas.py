"""OpenAI request bodies, validated with pydantic; unknown fields are ignored, as OpenAI servers do, and
known ones are checked as strictly as vLLM checks them (seed range, stream_options only with stream,
image_url and video_url as objects).

Extensions some servers accept (vLLM's `top_k`, `ignore_eos`, `cache_salt`, `mm_processor_kwargs`) are
taken too, e.g. from the official client's `extra_body`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.errors import APIError, bad_request

UINT32_MAX = 2**32 - 1
MAX_N = 128  # OpenAI's bound on `n`


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ImageURL(_Lenient):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class ImagePart(_Lenient):
    type: Literal["image_url"]
    image_url: ImageURL  # OpenAI's object form only, as vLLM requires: a bare string is a 400

    @property
    def url(self) -> str:
        return self.image_url.url


class VideoURL(_Lenient):
    url: str


class VideoPart(_Lenient):
    """vLLM's `{"type": "video_url", "video_url": {"url": ...}}` part (Qwen2.5-VL, Qwen3-VL)."""

    type: Literal["video_url"]
    video_url: VideoURL

    @property
    def url(self) -> str:
        return self.video_url.url


ContentPart = Annotated[TextPart | ImagePart | VideoPart, Field(discriminator="type")]


class Message(_Lenient):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class StreamOptions(_Lenient):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage (tokens so far) on every chunk


class _SamplingFields(_Lenient):
    """Fields both endpoints share."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)  # vLLM's bound: a signed 64-bit seed
    n: int = Field(default=1, ge=1, le=MAX_N)  # choices: n decoder requests sharing the prompt's KV
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # Extensions (vLLM's names).
    top_k: int | None = Field(default=None, ge=-1, le=2**31 - 1)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0, le=UINT32_MAX)
    cache_salt: str | None = None  # its limit: gateway/admission.py check_salt

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk (vLLM's continuous_usage_stats, which also needs include_usage)."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


class MMProcessorKwargs(BaseModel):
    """vLLM's `mm_processor_kwargs`, as far as Qwen-VL's processors take them per request: the pixel range
    of every image and video of the request, and how its videos are sampled. Any other key is a 400: a
    setting dropped in silence would give other tokens than the user asked for. The decoder checks the
    values against the model's range and the server's caps."""

    model_config = ConfigDict(extra="forbid")
    min_pixels: int | None = Field(default=None, ge=1, le=2**63 - 1)
    max_pixels: int | None = Field(default=None, ge=1, le=2**63 - 1)
    fps: float | None = Field(default=None, gt=0.0, le=1000.0)  # frames sampled per second of video
    max_frames: int | None = Field(default=None, ge=1, le=UINT32_MAX)

    @property
    def given(self) -> bool:
        """Whether any setting was given."""
        return any(v is not None for v in (self.min_pixels, self.max_pixels, self.fps, self.max_frames))


class ChatCompletionRequest(_SamplingFields):
    messages: list[Message] = Field(min_length=1)
    mm_processor_kwargs: MMProcessorKwargs | None = None  # vLLM's extension (Qwen-VL models)
    max_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict] | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str]
    max_tokens: int | None = Field(default=16, ge=1, le=UINT32_MAX)  # OpenAI's default for completions
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


def parse_body(model: type[BaseModel], body: object) -> BaseModel:
    """Validate a JSON body; the first problem becomes a 400 naming the field as OpenAI does."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        # The deepest location is the most telling one among a union's alternatives.
        first = max(exc.errors(), key=lambda e: len(e["loc"]))
        param = _param_name(first["loc"])
        raise APIError(400, f"{param}: {first['msg']}" if param else first["msg"], param=param,
                       code="invalid_value") from None


def _param_name(loc: tuple) -> str | None:
    """`messages.0.content.1.image_url` from pydantic's location, without its union-branch labels
    ("str", "list[...]") and with a discriminator tag that repeats the field name said once."""
    parts: list[str] = []
    for p in loc:
        text = str(p)
        if "[" in text or text[:1].isupper() or text in ("str", "int", "float", "bool"):
            continue
        if parts and parts[-1] == text:
            continue
        parts.append(text)
    return ".".join(parts) or None
