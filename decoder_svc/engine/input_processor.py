"""Input processing: a client's request turned into an engine Request, before any engine work.

Validation (sizes first, so nothing is decoded or tokenized for a request refused on them), image
header probing, decoding and content hashing, tokenization with image placeholders, and the length
checks. It reads only what never changes after start-up (the tokenizer, the model's limits, the KV
capacity), so the service runs it on any thread, or in another process than the engine's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from PIL import Image

from common.checkpoint import model_fingerprint
from common.hashing import check_cache_salt, hash_image, is_content_hash
from common.images import decode_image, probe_image_size
from decoder_svc.engine.request import ImagePlaceholder, Request
from decoder_svc.engine.sampling_params import InvalidRequestError, SamplingParams
from decoder_svc.model import generation_eos_ids
from decoder_svc.model.config import TextModelConfig
from decoder_svc.model.loader import text_config_dict
from decoder_svc.tokenization import PromptTokenizer, TokenizedPrompt

if TYPE_CHECKING:
    from decoder_svc.engine.config import EngineConfig


ImageLike = bytes | Image.Image | str  # encoded file, decoded image, or the hex content hash of a known one


@dataclass
class InputProcessor:
    """Makes Requests for one model; see the module docstring."""

    config: EngineConfig
    model_config: TextModelConfig
    tokenizer: PromptTokenizer
    fingerprint: str
    eos_token_ids: frozenset[int]
    kv_capacity_tokens: int  # blocks x block size: no request may need more

    @classmethod
    def for_model(cls, config: EngineConfig, kv_capacity_tokens: int) -> InputProcessor:
        """Everything from the checkpoint directory: tokenizer and configs, no weights."""
        return cls(config, TextModelConfig.from_hf(text_config_dict(config.model)),
                   PromptTokenizer(config.model), model_fingerprint(config.model),
                   frozenset(generation_eos_ids(config.model)), kv_capacity_tokens)

    def make_request(
        self,
        request_id: str,
        prompt: str | None = None,
        images: Sequence[ImageLike] = (),
        *,
        messages: list[dict[str, Any]] | None = None,
        sampling: SamplingParams | None = None,
        cache_salt: str = "",
    ) -> Request:
        """Validate, decode and hash images, tokenize: everything but queueing. It reads engine state
        that never changes, so a server runs it off the engine thread and a large image's decoding
        never delays the running requests' steps.

        `prompt` marks images with `<image>`; `messages` (chat) go through the chat template and mark
        images with {"type": "image"} parts. `images` are, in order, encoded files, PIL images, or hex
        content hashes the encoder holds. Raises InvalidRequestError / PromptError (ValueError
        subclasses) for bad input.
        """
        # Cheapest checks first: nothing is decoded or tokenized for a request refused on its sizes.
        sampling = sampling or SamplingParams()
        sampling.validate(self.model_config.vocab_size)
        self._check_sizes(prompt, messages, images, cache_salt)
        sizes = [self._image_size(i, img) for i, img in enumerate(images)]  # headers only
        if messages is not None:
            tokenized = self.tokenizer.encode_chat(messages, sizes)
        elif prompt:
            tokenized = self.tokenizer.encode_prompt(prompt, sizes)
        else:
            raise InvalidRequestError("empty input: give a prompt or chat messages")
        max_tokens = sampling.max_tokens or self.config.default_max_tokens
        self._check_length(tokenized, max_tokens)
        decoded = [self._open_image(i, img) for i, img in enumerate(images)]
        placeholders = [
            ImagePlaceholder(
                offset=ph.offset, length=ph.length, image=src if not isinstance(src, str) else None,
                content_hash=src if isinstance(src, str) else hash_image(img, self.fingerprint, cache_salt))
            for ph, src, img in zip(tokenized.placeholders, images, decoded, strict=True)
        ]
        return Request(
            request_id=request_id, prompt_token_ids=tokenized.token_ids, sampling=sampling,
            max_tokens=max_tokens, eos_token_ids=self.eos_token_ids, images=placeholders,
            cache_salt=cache_salt,
        )

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

    def _open_image(self, index: int, image: ImageLike) -> Image.Image | None:
        # Decoding is needed anyway: the content hash covers the decoded pixels.
        if isinstance(image, str):
            return None
        if isinstance(image, bytes):
            try:
                return decode_image(image, self.config.image_limits)
            except ValueError as exc:
                raise InvalidRequestError(f"image {index}: {exc}") from None
        if isinstance(image, Image.Image):
            return image.convert("RGB")
        raise InvalidRequestError(f"image {index}: unsupported type {type(image).__name__}")

    def _check_length(self, tokenized: TokenizedPrompt, max_tokens: int) -> None:
        total = len(tokenized.token_ids) + max_tokens
        if total > self.model_config.max_model_len:
            n_prompt = len(tokenized.token_ids)
            raise InvalidRequestError(f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) "
                                      f"exceeds the context length {self.model_config.max_model_len}")
        capacity = self.kv_capacity_tokens
        if total > capacity:
            raise InvalidRequestError(f"prompt + max_tokens ({total}) exceeds the KV cache ({capacity})")
