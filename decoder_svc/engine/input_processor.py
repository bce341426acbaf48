"""Input processing: a client's request turned into an engine Request, before any engine work.

Validation (sizes first, so nothing is decoded or tokenized for a request refused on them), image
header probing, decoding and content hashing, tokenization with image placeholders, and the length
checks. It reads only what never changes after start-up (the tokenizer, the model's limits, the KV
capacity), so the service runs it on any thread, or in another process than the engine's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from PIL import Image

from common.checkpoint import model_fingerprint
from common.families.layout import ImageLayout
from common.freed_memory import release_freed_memory
from common.hashing import check_cache_salt, hash_image, hash_image_file, is_content_hash
from common.image_geometry import Grid, ImageGeometryError, ImageSettings, hash_fingerprint
from common.images import probe_image_size, to_rgb
from common.memo import BoundedMemo
from decoder_svc.engine.embedding_source import VideoSource
from decoder_svc.engine.fanout import MAX_SAMPLES
from decoder_svc.engine.new_request import ImageLike, ImageOptions, NewRequest
from decoder_svc.engine.request import ImagePlaceholder, Request
from decoder_svc.engine.sampling_params import InvalidRequestError, SamplingParams
from decoder_svc.engine.videos import VideoInputs
from decoder_svc.model import generation_eos_ids
from decoder_svc.model.config import TextModelConfig
from decoder_svc.model.loader import text_config_dict
from decoder_svc.tokenization import PromptTokenizer, TokenizedPrompt

if TYPE_CHECKING:
    from decoder_svc.engine.config import EngineConfig


MAX_REMEMBERED_GRIDS = 65536  # (salt, content hash) -> grid of sized images seen, for hash-only requests


@dataclass
class _SizedImages:
    """A request's images as the layout sizes them, before hashing: each one's (height, width) from its
    header (None for a hash), settings (a pixel range, a crop choice, or None), grid (None: a
    fixed-count image), and every image's token count when any is sized (None: the layout's fixed
    count, which the tokenizer asks for)."""

    sizes: list[tuple[int, int] | None]
    settings: list[ImageSettings | None]
    grids: list[Grid | None]
    counts: list[int] | None


@dataclass
class InputProcessor:
    """Makes Requests for one model; see the module docstring."""

    config: EngineConfig
    model_config: TextModelConfig
    tokenizer: PromptTokenizer
    fingerprint: str
    eos_token_ids: frozenset[int]
    kv_capacity_tokens: int  # blocks x block size: no request may need more
    # make_request runs on any thread: the memo is thread-safe
    _grids: BoundedMemo[Grid] = field(default_factory=lambda: BoundedMemo(MAX_REMEMBERED_GRIDS), repr=False)
    _videos: VideoInputs | None = field(default=None, repr=False)
    _adapters: list[str] | None = field(default=None, repr=False)

    @property
    def _served_adapters(self) -> list[str]:
        """The adapters a request may run with (EngineConfig.served_adapters, read once)."""
        if self._adapters is None:
            self._adapters = self.config.served_adapters
        return self._adapters

    @property
    def videos(self) -> VideoInputs:
        """Video planning for this model (refuses videos where the model takes none)."""
        if self._videos is None:
            self._videos = VideoInputs.for_model(self.config, self.fingerprint, self.layout)
        return self._videos

    @property
    def layout(self) -> ImageLayout:
        """The model's image layout (common/families/layout.py), the tokenizer's."""
        return self.tokenizer.layout

    @classmethod
    def for_model(cls, config: EngineConfig, kv_capacity_tokens: int) -> InputProcessor:
        """Everything from the checkpoint directory: tokenizer and configs, no weights."""
        return cls(config, TextModelConfig.from_hf(text_config_dict(config.model)),
                   PromptTokenizer(config.model), model_fingerprint(config.model),
                   frozenset(generation_eos_ids(config.model)), kv_capacity_tokens)

    def make_request(self, request_id: str, prompt: str | None = None, images: Sequence[ImageLike] = (),
                     **fields: Any) -> Request:
        """`make` of NewRequest(request_id, prompt, images, **fields) (new_request.py names the fields)."""
        return self.make(NewRequest(request_id, prompt, images, **fields))

    def make(self, new: NewRequest) -> Request:
        """Validate, decode and hash images, tokenize: everything but queueing. It reads engine state
        that never changes, so a server runs it off the engine thread and a large image's decoding
        never delays the running requests' steps. Only videos' headers are read here. Raises
        InvalidRequestError / PromptError (ValueError subclasses) for bad input.
        """
        # Cheapest checks first: nothing is decoded or tokenized for a request refused on its sizes.
        sampling = new.sampling or SamplingParams()
        sampling.validate(self.model_config.vocab_size)
        if not 1 <= new.n <= MAX_SAMPLES:
            raise InvalidRequestError(f"n must be in [1, {MAX_SAMPLES}], got {new.n}")
        self._check_sizes(new.prompt, new.messages, new.images, new.cache_salt)
        adapter = self._adapter(new.lora_adapter, bool(new.images), bool(new.videos))
        sized = self._size_images(new)
        planned = self.videos.plan(new.videos, new.cache_salt) if new.videos else []
        plans = [plan for plan, _ in planned]
        if sized.counts is not None:
            self._check_image_tokens(sized.counts, [p.num_tokens for p in plans])
        tokenized = self._tokenize(new, sized, [self.videos.prompt_layout(p) for p in plans])
        max_tokens = sampling.max_tokens or self.config.default_max_tokens
        self._check_length(tokenized, max_tokens)
        keys = self._content_hashes(new.images, sized.settings, new.cache_salt)
        placeholders = self._image_placeholders(new, tokenized, sized, keys)
        video_placeholders, spans = self._video_placeholders(tokenized, planned)
        placeholders += video_placeholders
        placeholders.sort(key=lambda p: p.offset)
        req = Request(
            request_id=new.request_id, prompt_token_ids=tokenized.token_ids, sampling=sampling,
            max_tokens=max_tokens, eos_token_ids=self.eos_token_ids, images=placeholders,
            cache_salt=new.cache_salt, lora_adapter=adapter, n=new.n,
        )
        if self.layout.mrope:  # M-RoPE spans: (offset, grid) of images, beside the videos'
            spans += [(p.offset, p.grid) for p in placeholders if p.video is None]
            req.mrope_positions, req.mrope_delta = self.layout.positions(len(req.prompt_token_ids), spans)
        return req

    def _size_images(self, new: NewRequest) -> _SizedImages:
        """Each image's header size, settings and, where the layout sizes it, grid and token count."""
        images, salt, known = new.images, new.cache_salt, new.known_grids
        sizes = [self._image_size(i, img) for i, img in enumerate(images)]  # headers only
        # Each image's settings: a pixel range (Qwen-VL), a crop choice (Gemma 3), or None (LLaVA).
        settings = self._image_settings(len(images), new.image_options)
        grids: list[Grid | None] = [None] * len(images)
        counts = None  # a fixed-count layout's: the tokenizer asks it
        is_sized = [self.layout.sizes_image(pixels) for pixels in settings]
        for i, img in enumerate(images):  # a hash names its embedding: a grid known for it decides
            if isinstance(img, str) and not is_sized[i]:  # (Gemma 3: an image hashed with crops on)
                is_sized[i] = ((known or {}).get(img) or self.known_grid(salt, img)) is not None
        # each sized image's grid (from its size, in a pixel range or cropped) and every image's count
        # (a layout whose images are sized by default has no fixed count to fall back on)
        if any(is_sized) or self.layout.sized_by_image:
            grids = [self._grid(i, img, size, pixels, salt, known) if sized else None
                     for i, (img, size, pixels, sized)
                     in enumerate(zip(images, sizes, settings, is_sized, strict=True))]
            counts = [self.layout.num_tokens(g) for g in grids]  # grid None: a fixed-count image's count
        return _SizedImages(sizes, settings, grids, counts)

    def _tokenize(self, new: NewRequest, sized: _SizedImages, video_layouts: list) -> TokenizedPrompt:
        """The prompt's token ids with a placeholder run per image (and per video span)."""
        if new.prompt_token_ids is not None:
            return self._token_id_prompt(new.prompt_token_ids, new.images, new.videos)
        if new.messages is not None:
            return self.tokenizer.encode_chat(new.messages, sized.sizes, image_token_counts=sized.counts,
                                              videos=video_layouts)
        if new.prompt:
            return self.tokenizer.encode_prompt(new.prompt, sized.sizes, image_token_counts=sized.counts,
                                                videos=video_layouts)
        raise InvalidRequestError("empty input: give a prompt or chat messages")

    def _content_hashes(self, images: Sequence[ImageLike], settings: Sequence[ImageSettings | None],
                        cache_salt: str) -> list[str]:
        """Each image's content hash. Files are named by their bytes (nothing decoded: the encoder decodes
        an image it lacks); in-process PIL images by their pixels, one converted at a time."""
        try:
            return [src if isinstance(src, str) else self._hash_image(i, src, pixels, cache_salt)
                    for i, (src, pixels) in enumerate(zip(images, settings, strict=True))]
        finally:  # refused on its last image or not, a request leaves no converted memory held
            if any(isinstance(src, Image.Image) for src in images):
                release_freed_memory()

    def _image_placeholders(self, new: NewRequest, tokenized: TokenizedPrompt, sized: _SizedImages,
                            keys: list[str]) -> list[ImagePlaceholder]:
        """The images' placeholders, in image order; each sized image's grid remembered under its hash."""
        placeholders = []
        runs: list[list] = [[] for _ in new.images]  # each image's runs (several: Gemma 3's crops)
        for ph in tokenized.placeholders:
            runs[ph.image_index].append(ph)
        for image_runs, src, key, grid, pixels in zip(runs, new.images, keys, sized.grids, sized.settings,
                                                      strict=True):
            # An image of several runs is one embedding whose rows they take in turn, as a video's runs.
            total = sum(ph.length for ph in image_runs) if len(image_runs) > 1 else None
            row = 0
            for ph in image_runs:
                placeholders.append(ImagePlaceholder(
                    offset=ph.offset, length=ph.length, image=src if not isinstance(src, str) else None,
                    content_hash=key, grid=grid, pixels=pixels, row_offset=row, embedding_rows=total))
                row += ph.length
            if grid is not None:
                self._remember_grid(new.cache_salt, key, grid)
        return placeholders

    def _video_placeholders(self, tokenized: TokenizedPrompt,
                            planned: list) -> tuple[list[ImagePlaceholder], list[tuple]]:
        """The videos' placeholders (a run per time span, each its rows of the video's one embedding) and
        their M-RoPE spans: (offset, grid, time interval)."""
        placeholders, spans = [], []
        for runs, (plan, src) in zip(tokenized.video_spans, planned, strict=True):
            for k, run in enumerate(runs):
                grid = self.videos.span_grid(plan, len(runs))
                placeholders.append(ImagePlaceholder(
                    offset=run.offset, length=run.length, content_hash=plan.content_hash, grid=grid,
                    row_offset=k * run.length, embedding_rows=plan.num_tokens, video=src))
                spans.append((run.offset, grid, self.videos.time_interval(plan, len(runs))))
        return placeholders, spans

    # -- images sized by the layout (pixel ranges, grids) ----------------------------------------
    def _image_settings(self, count: int,
                        options: Sequence[ImageOptions] | None) -> list[ImageSettings | None]:
        """Each image's settings from the request's options (the layout's image_settings): INVALID_ARGUMENT
        naming the image for a range outside the server's or pan_and_scan on a model without crops."""
        options = list(options or [])
        if len(options) > count:
            raise InvalidRequestError(f"{len(options)} image options for {count} images")
        if not count:  # a text request: no cap to ask the layout for (Phi-4-MM's take no pixel range)
            return []
        options += [ImageOptions()] * (count - len(options))
        cap = None
        if self.layout.sized_by_image and self.layout.pixel_ranges:  # Qwen-VL: the server's cap
            cap = self.layout.max_pixels_for(self.config.max_image_tokens)
        out = []
        for i, opt in enumerate(options):
            try:
                out.append(self.layout.image_settings(opt.min_pixels, opt.max_pixels, opt.pan_and_scan, cap))
            except ImageGeometryError as exc:
                raise InvalidRequestError(f"image {i}: {exc}") from None
        return out

    def _grid(self, index: int, image: ImageLike, size: tuple[int, int] | None, pixels: ImageSettings | None,
              salt: str, known: Mapping[str, Grid] | None) -> Grid:
        if size is not None:
            try:
                return self.layout.grid(size[0], size[1], pixels)
            except ImageGeometryError as exc:
                raise InvalidRequestError(f"image {index}: {exc}") from None
        grid = (known or {}).get(image) or self.known_grid(salt, image)
        if grid is None:
            raise InvalidRequestError(f"image {index}: the grid of content hash {image} is unknown here; "
                                      "send the image bytes instead")
        try:
            return self.layout.check_grid(grid)
        except ImageGeometryError as exc:
            raise InvalidRequestError(f"image {index}: {exc}") from None

    def _check_image_tokens(self, counts: list[int], video_counts: Sequence[int] = ()) -> None:
        cfg = self.config
        for i, n in enumerate(counts):
            if n > cfg.max_image_tokens:
                raise InvalidRequestError(f"image {i}: {n} image tokens; at most {cfg.max_image_tokens} "
                                          "per image")
        total = sum(counts) + sum(video_counts)
        if total > cfg.max_image_tokens_per_request:
            raise InvalidRequestError(f"{total} image and video tokens; at most "
                                      f"{cfg.max_image_tokens_per_request} per request")

    def _remember_grid(self, salt: str, content_hash: str, grid: Grid) -> None:
        self._grids.put((salt, content_hash), grid)

    def _adapter(self, name: str, has_images: bool, has_videos: bool) -> str:
        """The LoRA adapter the request runs with: its own, else the family's pick; checked to be served."""
        name = name or self.layout.request_adapter(has_images, has_videos) or ""
        if name and name not in self._served_adapters:
            served = ", ".join(repr(n) for n in self._served_adapters) or "none"
            # The name as sent may be huge: echo its start, so the error fits any message limit.
            shown = repr(name) if len(name) <= 64 else f"{name[:64]!r}... ({len(name)} characters)"
            raise InvalidRequestError(f"unknown LoRA adapter {shown} (served: {served})")
        return name

    def known_grid(self, salt: str, content_hash: str) -> Grid | None:
        """The grid of a sized image this processor has hashed under salt, if it remembers one."""
        return self._grids.get((salt, content_hash))

    def _check_sizes(self, prompt: str | None, messages: list[dict[str, Any]] | None,
                     images: Sequence[ImageLike], cache_salt: str) -> None:
        """Refuse oversized input before any work on it (the limits are EngineConfig's)."""
        cfg = self.config
        max_images = cfg.image_limits.max_images_per_request
        if len(images) > max_images:
            raise InvalidRequestError(f"{len(images)} images; at most {max_images} per request")
        text_bytes = len((prompt or "").encode())
        for message in messages or []:
            content = message.get("content") if isinstance(message, dict) else None
            parts = content if isinstance(content, list) else [{"text": content or ""}]
            text_bytes += sum(len(str(p.get("text", "")).encode()) for p in parts if isinstance(p, dict))
        if text_bytes > cfg.max_prompt_bytes:
            raise InvalidRequestError(f"prompt of {text_bytes} bytes exceeds the limit of "
                                      f"{cfg.max_prompt_bytes}")
        problem = check_cache_salt(cache_salt)
        if problem is not None:
            raise InvalidRequestError(problem)

    def _image_size(self, index: int, image: ImageLike) -> tuple[int, int] | None:
        """(height, width) from the image's header, or None for a content hash (checked here)."""
        if isinstance(image, str):
            if not is_content_hash(image):
                raise InvalidRequestError(f"image {index}: not a content hash: {image[:20]!r}")
            return None
        if isinstance(image, bytes):
            try:
                return probe_image_size(image, self.config.image_limits)
            except ValueError as exc:
                raise InvalidRequestError(f"image {index}: {exc}") from None
        if isinstance(image, Image.Image):
            return image.height, image.width
        raise InvalidRequestError(f"image {index}: unsupported type {type(image).__name__}")

    def _hash_image(self, index: int, image: bytes | Image.Image, pixels: ImageSettings | None,
                    cache_salt: str) -> str:
        """The content hash of one image (common/hashing.py): a file's from its bytes, without decoding it
        (its header was checked); a PIL image's from its RGB pixels, converted inside this call only."""
        # The image's settings (a pixel range, Gemma 3's crop choice), as the encoders hash them.
        fingerprint = hash_fingerprint(self.fingerprint + self.layout.hash_key, pixels)
        if isinstance(image, bytes):
            return hash_image_file(image, fingerprint, cache_salt)
        if isinstance(image, Image.Image):
            return hash_image(to_rgb(image), fingerprint, cache_salt)
        raise InvalidRequestError(f"image {index}: unsupported type {type(image).__name__}")

    def _token_id_prompt(self, ids: Sequence[int], images: Sequence[ImageLike],
                         videos: Sequence[VideoSource]) -> TokenizedPrompt:
        """A prompt given as token ids (vLLM's), checked: text only, every id in the vocabulary and none
        a placeholder the family declares (an image or video token would need an embedding nobody sent;
        Phi-4-MM's audio token stands for input no service takes)."""
        if images or videos:
            raise InvalidRequestError("a token-id prompt takes no images or videos")
        if not ids:
            raise InvalidRequestError("empty input: the token-id prompt has no ids")
        if len(ids) >= self.model_config.max_model_len:  # before looking at each id
            raise InvalidRequestError(f"prompt ({len(ids)} tokens) exceeds the context length "
                                      f"{self.model_config.max_model_len}")
        vocab, placeholders = self.model_config.vocab_size, self.tokenizer.placeholder_token_ids
        for index, token_id in enumerate(ids):
            if not 0 <= token_id < vocab:
                raise InvalidRequestError(f"prompt token {index}: id {token_id} is outside the vocabulary "
                                          f"(0 to {vocab - 1})")
            if token_id in placeholders:
                kind = placeholders[token_id]
                if kind in ("image", "video"):
                    raise InvalidRequestError(f"prompt token {index}: id {token_id} is an image or video "
                                              "placeholder; send images through a text prompt or chat")
                raise InvalidRequestError(f"prompt token {index}: id {token_id} is the placeholder of {kind} "
                                          "input, which is not served")
        return TokenizedPrompt(list(ids), [], "")

    def _check_length(self, tokenized: TokenizedPrompt, max_tokens: int) -> None:
        total = len(tokenized.token_ids) + max_tokens
        if total > self.model_config.max_model_len:
            n_prompt = len(tokenized.token_ids)
            raise InvalidRequestError(f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) "
                                      f"exceeds the context length {self.model_config.max_model_len}")
        capacity = self.kv_capacity_tokens
        if total > capacity:
            raise InvalidRequestError(f"prompt + max_tokens ({total}) exceeds the KV cache ({capacity})")

