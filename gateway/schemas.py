"""OpenAI request bodies, validated with pydantic; unknown fields are ignored, as OpenAI servers do, and
known ones are checked as strictly as vLLM checks them (seed range, stream_options only with stream,
image_url and video_url as objects).

Extensions some servers accept (vLLM's `top_k`, `ignore_eos`, `cache_salt`, `mm_processor_kwargs`) are
taken too, e.g. from the official client's `extra_body`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

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


class _NamedMedia(_Lenient):
    """vLLM's `uuid`: a client's name for the file (media_memo.py); the file may then be left out."""

    uuid: str | None = Field(default=None, min_length=1, max_length=256)

    @model_validator(mode="before")
    @classmethod
    def _empty_means_none(cls, data: object) -> object:
        """vLLM's uuid-reuse form `"image_url": {}` (or `"video_url": {}`) with a uuid names no file, as
        null does (without a uuid, `{}` stays an object without its url: a 400 naming the url)."""
        if isinstance(data, dict) and isinstance(data.get("type"), str) and data.get(data["type"]) == {} \
                and data.get("uuid") is not None:
            data = {**data, data["type"]: None}
        return data

    def model_post_init(self, context: object) -> None:
        if self.uuid is None and getattr(self, self.type) is None:
            raise ValueError(f"{self.type} is required unless the part names a file sent before by its uuid")


class ImagePart(_NamedMedia):
    type: Literal["image_url"]
    image_url: ImageURL | None = None  # OpenAI's object form only, as vLLM requires: a bare string is a 400

    @property
    def url(self) -> str | None:
        """The URL, or None for a part that names a known file by its uuid only."""
        return self.image_url.url if self.image_url is not None else None


class VideoURL(_Lenient):
    url: str


class VideoPart(_NamedMedia):
    """vLLM's `{"type": "video_url", "video_url": {"url": ...}}` part (Qwen2.5-VL, Qwen3-VL)."""

    type: Literal["video_url"]
    video_url: VideoURL | None = None

    @property
    def url(self) -> str | None:
        """The URL, or None for a part that names a known file by its uuid only."""
        return self.video_url.url if self.video_url is not None else None


class AudioPart(_Lenient):
    """OpenAI's `{"type": "input_audio", "input_audio": {"data", "format"}}` part (and vLLM's `audio_url`):
    parsed only to be refused by name, a 400 naming the part before anything is fetched. No served model
    takes audio (Phi-4-multimodal's audio encoder is not served)."""

    type: Literal["input_audio", "audio_url"]

    def model_post_init(self, context: object) -> None:
        raise ValueError(f"audio input ({self.type} parts) is not served; send text and images only")


ContentPart = Annotated[TextPart | ImagePart | VideoPart | AudioPart, Field(discriminator="type")]


ROLE_PATTERN = r"^[A-Za-z][A-Za-z0-9_.-]{0,63}$"  # a name, never text that could reshape the template


class Message(_Lenient):
    # system, developer (OpenAI's newer system), user, assistant, or a custom role the chat template
    # renders (as vLLM accepts them); a template that cannot render it makes the decoder answer 400.
    role: str = Field(pattern=ROLE_PATTERN)
    content: str | list[ContentPart] | None = None
    name: str | None = None


class StreamOptions(_Lenient):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage (tokens so far) on every chunk


class _SamplingFields(_Lenient):
    """Fields both endpoints share."""

    model: str | None = None  # None: the served model (vLLM's rule)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)  # vLLM's bound: a signed 64-bit seed
    n: int = Field(default=1, ge=1, le=MAX_N)  # choices: one decoder request for n samples
    user: str | None = Field(default=None, max_length=256)  # OpenAI's end-user id: session affinity only
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict | None = None  # only {"type": "text"} is honoured (translate.py refuses others)
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


class PixelSize(BaseModel):
    """HF's newer form of a Qwen-VL pixel range: `size: {"shortest_edge": min, "longest_edge": max}`
    (pixel counts, despite the names)."""

    model_config = ConfigDict(extra="forbid")
    shortest_edge: int | None = Field(default=None, ge=1, le=2**63 - 1)
    longest_edge: int | None = Field(default=None, ge=1, le=2**63 - 1)


class MMProcessorKwargs(BaseModel):
    """vLLM's `mm_processor_kwargs`, as far as the served processors take them per request: the pixel range
    of every image and video of the request (Qwen-VL: `min_pixels`/`max_pixels`, or HF's `size` form), how
    its videos are sampled, and whether every image is cut into pan-and-scan crops (Gemma 3:
    `do_pan_and_scan`; unset: the checkpoint's). `do_sample_frames` may be true (the server always samples
    frames by fps and max_frames); false, or any other key, is a 400: a setting dropped in silence would
    give other tokens than the user asked for. The decoder checks the values against the server's caps and
    the model (do_pan_and_scan true on a model without crops is its INVALID_ARGUMENT, a 400)."""

    model_config = ConfigDict(extra="forbid")
    min_pixels: int | None = Field(default=None, ge=1, le=2**63 - 1)
    max_pixels: int | None = Field(default=None, ge=1, le=2**63 - 1)
    size: PixelSize | None = None
    fps: float | None = Field(default=None, gt=0.0, le=1000.0)  # frames sampled per second of video
    max_frames: int | None = Field(default=None, ge=1, le=UINT32_MAX)
    do_sample_frames: bool | None = None
    do_pan_and_scan: bool | None = None  # Gemma 3: every image of the request cropped or not

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: object) -> object:
        """An unknown key is a 400 that names it and lists the keys served (not pydantic's bare "extra
        inputs are not permitted")."""
        if isinstance(data, dict):
            unknown = [key for key in data if key not in cls.model_fields]
            if unknown:
                raise bad_request(f"mm_processor_kwargs.{unknown[0]}: unknown key; the keys served are "
                                  f"{', '.join(cls.model_fields)}", f"mm_processor_kwargs.{unknown[0]}",
                                  "invalid_value")
        return data

    def model_post_init(self, context: object) -> None:
        if self.do_sample_frames is False:
            raise bad_request("mm_processor_kwargs.do_sample_frames: false is not supported; the server "
                              "samples a video's frames itself (set fps and max_frames to choose how)",
                              "mm_processor_kwargs.do_sample_frames", "unsupported_value")
        if self.size is not None:  # HF's names for the same two numbers; both forms must agree
            pairs = (("min_pixels", self.size.shortest_edge), ("max_pixels", self.size.longest_edge))
            for name, value in pairs:
                given = getattr(self, name)
                if value is not None and given is not None and given != value:
                    raise bad_request(f"mm_processor_kwargs: {name} {given} and size {value} disagree",
                                      f"mm_processor_kwargs.{name}", "invalid_value")
                if value is not None:
                    setattr(self, name, value)

    @property
    def given(self) -> bool:
        """Whether any setting was given."""
        return any(v is not None for v in (self.min_pixels, self.max_pixels, self.fps, self.max_frames))


class ChatCompletionRequest(_SamplingFields):
    messages: list[Message] = Field(min_length=1)
    mm_processor_kwargs: MMProcessorKwargs | None = None  # vLLM's extension (Qwen-VL models)
    # vLLM's media loading options (e.g. {"video": {"num_frames": 8}}): refused with a 400 rather than
    # ignored (translate.py), since frames are chosen by mm_processor_kwargs' fps and max_frames here.
    media_io_kwargs: dict | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict] | None = None
    # Parsed to be refused by name where not honoured (translate.py), never silently dropped.
    functions: list[dict] | None = None  # OpenAI's legacy form of tools
    function_call: str | dict | None = None
    modalities: list[str] | None = None  # output modalities: ["text"] is the only one served


TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]


class CompletionRequest(_SamplingFields):
    # Text, or token ids (vLLM's): a string or a list of ids, or several prompts as a list of strings or
    # of id lists (one choice per prompt and `n`, as OpenAI and vLLM answer them). The body's JSON value
    # limit bounds how many ids; admission.py bounds prompts x n.
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
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
