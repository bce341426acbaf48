"""What a client asks the decoder for, before any check: the one value that travels from the service (or
`LLMEngine.add_request`) to `InputProcessor.make`, which turns it into an engine Request."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Any

from PIL import Image

from common.image_geometry import Grid
from decoder_svc.engine.embedding_source import VideoSource
from decoder_svc.engine.sampling_params import SamplingParams

ImageLike = bytes | Image.Image | str  # encoded file, decoded image, or the hex content hash of a known one


@dataclass(frozen=True)
class ImageOptions:
    """Per-image processor settings a request may give (vLLM's mm_processor_kwargs): a Qwen2.5-VL image
    is resized into [min_pixels, max_pixels], within the server's range, 0 keeping the model's value; a
    Gemma 3 image is cut into pan-and-scan crops or not (None: the checkpoint's do_pan_and_scan; true on
    a model without crops is refused)."""

    min_pixels: int = 0
    max_pixels: int = 0
    pan_and_scan: bool | None = None


@dataclass(frozen=True)
class NewRequest:
    """A request as the client gave it (unchecked).

    `prompt` marks images with `<image>`; `messages` (chat) go through the chat template and mark images
    with {"type": "image"} parts. `images` are, in order, encoded files, PIL images, or hex content hashes
    the encoder holds. `videos` (Qwen-VL: `<|video_pad|>` markers, {"type": "video"} parts) are container
    files with their settings. `prompt_token_ids` is a prompt already tokenized (text only), used as it
    is. `lora_adapter` names a --lora-modules adapter ("": the one the family picks for the request's
    content, else none). `n` asks for that many samples of the prompt, prefilled once. `known_grids` are
    grids of hash-only images the caller looked up (an encoder's).
    """

    request_id: str
    prompt: str | None = None
    images: Sequence[ImageLike] = ()
    _: KW_ONLY
    messages: list[dict[str, Any]] | None = None
    sampling: SamplingParams | None = None
    cache_salt: str = ""
    image_options: Sequence[ImageOptions] | None = None
    known_grids: Mapping[str, Grid] | None = None
    videos: Sequence[VideoSource] = ()
    prompt_token_ids: Sequence[int] | None = None
    lora_adapter: str = ""
    n: int = 1  # samples of the prompt (engine/fanout.py): choice i samples with seed + i
