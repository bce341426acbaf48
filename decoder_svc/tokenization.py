"""Prompt tokenization exactly as the checkpoint's Hugging Face processor does it.

`processor(text=prompt, images=...)` replaces each image token (`<image>`, Qwen's `<|image_pad|>`) with
N copies and tokenizes the result with the default special tokens. We do the same without decoding
pixels: the family's image layout (common/families/layout.py) says N. Where N does not depend on the
image (LLaVA) the layout derives it from the processor and vision configs (the encoder uses the same
number); where it follows the image (Qwen-VL) the caller passes each image's N, computed by the layout from
its header. The ids equal HF's; tests check it.

The placeholder is a special token, which the tokenizer splits out before it reads the text around it:
a run of N of them tokenizes to N copies of its id whatever N is. So the text is tokenized with each
run written once and the ids are repeated afterwards (a 1225-token image costs the tokenizer one token,
not 1225).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.checkpoint import load_config
from common.errors import InvalidInputError
from common.families import layout_family
from common.families.layout import ImageLayout

# Roles the LLaVA chat template is written for. The template itself prints any other role verbatim
# (`role.upper() + ': '`), so a client-chosen role could forge turns or template text in the prompt.
GENERIC_IMAGE_MARKER = "<image>"  # the API's image marker in a text prompt (the LLaVA family's own token)
CHAT_ROLES: frozenset[str] = frozenset({"system", "user", "assistant"})
# Any other role is taken when it is a name (vLLM passes custom roles to the template): never text that
# could reshape the rendered prompt. A template that cannot render it raises: PromptError.
CUSTOM_ROLE = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,63}")
# Content part types the template renders; it skips others silently, which would hide a client's bug.
CHAT_PART_TYPES: frozenset[str] = frozenset({"text", "image"})
VIDEO_CHAT_PART_TYPES: frozenset[str] = CHAT_PART_TYPES | {"video"}  # Qwen-VL templates render videos
# Audio parts (Phi-4-MM's template renders `{"type": "audio"}`; OpenAI's and vLLM's names): refused by name
AUDIO_PART_TYPES: frozenset[str] = frozenset({"audio", "input_audio", "audio_url"})


class PromptError(InvalidInputError):
    """A prompt the model cannot take (the service answers INVALID_ARGUMENT)."""


class PlaceholderMismatchError(PromptError):
    """The number of image placeholders differs from the number of images."""


@dataclass(frozen=True)
class PlaceholderRange:
    """The token span [offset, offset + length) that image number image_index fills."""

    offset: int
    length: int
    image_index: int


@dataclass(frozen=True)
class VideoPromptLayout:
    """How one video fills a Qwen-VL prompt: `groups` runs of `tokens_per_group` video tokens. Qwen3-VL
    writes each group's time before its run (`<1.5 seconds><|vision_start|>...<|vision_end|>`, as its
    processor does); Qwen2.5-VL's one run holds every group (groups == 1 here)."""

    groups: int
    tokens_per_group: int
    timestamps: tuple[float, ...] | None = None  # Qwen3-VL: one per group


@dataclass(frozen=True)
class TokenizedPrompt:
    """Prompt token ids with image (and video) placeholders already expanded."""

    token_ids: list[int]
    placeholders: list[PlaceholderRange]  # one per run of image tokens, in order (image_runs: one an image)
    text: str
    video_spans: list[list[PlaceholderRange]] = field(default_factory=list)  # per video, its runs


class PromptTokenizer:
    """Tokenizer + processor of one checkpoint, loaded offline from its directory."""

    def __init__(self, model_dir: str | Path) -> None:
        """The tokenizer, processor and image layout of the checkpoint in model_dir."""
        config = load_config(model_dir)
        # A config no family claims gets the fallback's layout, which refuses it at start-up saying why.
        family = layout_family(config)
        text = family.layout_class().load_text_processor(model_dir)
        self.processor, self.tokenizer, self.image_token = text.processor, text.tokenizer, text.image_token
        self.layout: ImageLayout = family.image_layout(model_dir, config)
        self.image_token_id: int = int(config.get("image_token_index", config.get("image_token_id", -1)))
        if self.image_token_id < 0:
            self.image_token_id = self.tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token: str | None = None
        self.video_token_id: int | None = None
        if self.layout.takes_video and config.get("video_token_id") is not None:
            self.video_token = getattr(self.tokenizer, "video_token", None) or self.layout.video_token
            self.video_token_id = int(config["video_token_id"])
        self.mm_token_ids: frozenset[int] = frozenset(
            {self.image_token_id} | ({self.video_token_id} if self.video_token_id is not None else set()))
        # {id: what it stands for} of every placeholder the family declares: a prompt given as token ids
        # may hold none (each needs an input nobody sent, or one no service takes).
        self.placeholder_token_ids: dict[int, str] = {
            **self._marker_ids(self.layout.unserved_markers), self.image_token_id: "image",
            **({self.video_token_id: "video"} if self.video_token_id is not None else {})}

    def _marker_ids(self, markers: dict[str, str]) -> dict[int, str]:
        """{token id: kind} of the markers that are single tokens of the vocabulary."""
        vocab = self.tokenizer.get_vocab() if markers else {}
        return {vocab[marker]: kind for marker, kind in markers.items() if marker in vocab}

    def num_image_tokens(self, image_size: tuple[int, int] | None = None) -> int:
        """Placeholder tokens for one image of (height, width) where the layout's count is fixed (it
        ignores the size). Where counts follow the image, callers pass image_token_counts."""
        count = self.layout.tokens_per_image
        if count is None:
            raise PromptError("this model's image token count depends on the image: pass image_token_counts")
        return count

    def encode_prompt(self, prompt: str, image_sizes: Sequence[tuple[int, int] | None] = (),
                      add_special_tokens: bool = True,
                      image_token_counts: Sequence[int] | None = None,
                      videos: Sequence[VideoPromptLayout] = ()) -> TokenizedPrompt:
        """Tokenize a prompt whose image markers stand for the given images, in order (one count per
        image in image_token_counts, or image_sizes for the LLaVA family's fixed count), and whose video
        markers (Qwen-VL's `<|video_pad|>`) stand for `videos`, in order."""
        if not prompt:
            raise PromptError("empty prompt")
        counts = list(image_token_counts) if image_token_counts is not None else [
            self.num_image_tokens(size) for size in image_sizes]
        if videos and self.video_token is None:
            raise PromptError("this model does not take video input")
        prompt = self._native_image_markers(prompt, len(counts))
        for marker, kind in self.layout.unserved_markers.items():
            if marker in prompt:
                raise PromptError(f"the prompt holds {marker}, the placeholder of {kind} input, which is not "
                                  "served; send text and images only")
        found = prompt.count(self.image_token)
        if found != len(counts):
            raise PlaceholderMismatchError(
                f"prompt has {found} {self.image_token} placeholders but {len(counts)} images")
        if self.video_token is not None and prompt.count(self.video_token) != len(videos):
            raise PlaceholderMismatchError(f"prompt has {prompt.count(self.video_token)} {self.video_token} "
                                           f"placeholders but {len(videos)} videos")
        # An image may be several runs of placeholders (Gemma 3's pan-and-scan: the original and its
        # crops, text between them): each run is written once, then repeated to its length.
        runs = [self.layout.image_runs(count) for count in counts]
        text = self._expand(prompt, [len(r) for r in runs], [_one_per_run(v) for v in videos])
        ids, image_found, video_found = self._repeat_runs(
            self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"],
            [n for r in runs for n in r], videos)
        spans = self._video_spans(ids, videos, video_found) if videos else []
        return TokenizedPrompt(ids, self._placeholders(ids, runs, image_found), text, spans)

    def _repeat_runs(self, ids: Sequence[int], counts: list[int], videos: Sequence[VideoPromptLayout]
                     ) -> tuple[list[int], list[tuple[int, int]], list[tuple[int, int]]]:
        """ids whose image and video tokens, each written once per run, are repeated to their runs'
        lengths (images in order, then each video's groups in order); with the (offset, length) of each
        image run and each video group written, so that nobody scans the expanded ids for them."""
        lengths = iter(counts)
        groups = iter([v.tokens_per_group for v in videos for _ in range(v.groups)])
        out: list[int] = []
        image_found: list[tuple[int, int]] = []
        video_found: list[tuple[int, int]] = []
        for token in ids:
            if token == self.image_token_id:
                n = next(lengths, 1)
                image_found.append((len(out), n))
                out.extend([token] * n)
            elif token == self.video_token_id and self.video_token_id is not None:
                n = next(groups, 1)
                video_found.append((len(out), n))
                out.extend([token] * n)
            else:
                out.append(token)
        return out, image_found, video_found

    def _native_image_markers(self, prompt: str, n_images: int) -> str:
        """A prompt that marks its images with the generic `<image>` (the API's and `mmserve generate`'s
        marker) and has none of the model's own, for a model whose marker differs (Qwen-VL): each `<image>`
        becomes the model's vision block, as its chat template writes it (the layout's
        generic_image_text). Prompts with the model's markers are left as HF takes them."""
        block = self.layout.generic_image_text(self.image_token)
        if (block is None or not n_images or self.image_token in prompt
                or prompt.count(GENERIC_IMAGE_MARKER) != n_images):
            return prompt
        return prompt.replace(GENERIC_IMAGE_MARKER, block)

    def _expand(self, prompt: str, runs: list[int], videos: Sequence[VideoPromptLayout]) -> str:
        """Each marker replaced by its tokens, one placeholder per run of its image (`runs` per image), as
        the HF processors do (Qwen3-VL's replaces a video's `<|video_pad|>` with its timestamped groups,
        inside the template's own vision start/end)."""
        markers = [self.image_token] + ([self.video_token] if self.video_token is not None else [])
        parts = re.split("(" + "|".join(re.escape(m) for m in markers) + ")", prompt)
        images, clips = iter(runs), iter(videos)
        out = [parts[0]]
        for marker, piece in zip(parts[1::2], parts[2::2], strict=True):
            out.append(self.layout.marker_text(marker, 1, next(images)) if marker == self.image_token
                       else self._video_text(next(clips)))
            out.append(piece)
        return "".join(out)

    def _video_text(self, video: VideoPromptLayout) -> str:
        pads = self.video_token * video.tokens_per_group
        if video.timestamps is None:  # Qwen2.5-VL: one run
            return pads * video.groups
        return "".join(self.layout.video_group_text(pads, t) for t in video.timestamps)

    def _video_spans(self, ids: list[int], videos: Sequence[VideoPromptLayout],
                     found: Sequence[tuple[int, int]] = ()) -> list[list[PlaceholderRange]]:
        expected = [video.tokens_per_group for video in videos for _ in range(video.groups)]
        if 0 not in expected and [n for _, n in found] == expected:  # as _repeat_runs wrote them: no scan
            it = iter(found)
            return [[PlaceholderRange(next(it)[0], video.tokens_per_group, index)
                     for _ in range(video.groups)] for index, video in enumerate(videos)]
        positions = [i for i, t in enumerate(ids) if t == self.video_token_id]
        if len(positions) != sum(v.groups * v.tokens_per_group for v in videos):
            raise PlaceholderMismatchError(f"tokenized prompt has {len(positions)} video tokens, expected "
                                           f"{sum(v.groups * v.tokens_per_group for v in videos)}")
        out, k = [], 0
        for index, video in enumerate(videos):
            runs = []
            for _ in range(video.groups):
                span = positions[k:k + video.tokens_per_group]
                if span[-1] - span[0] != video.tokens_per_group - 1:
                    raise PlaceholderMismatchError(f"video {index}: its placeholder tokens are not "
                                                   "contiguous")
                runs.append(PlaceholderRange(span[0], video.tokens_per_group, index))
                k += video.tokens_per_group
            out.append(runs)
        return out

    def encode_chat(self, messages: list[dict[str, Any]],
                    image_sizes: Sequence[tuple[int, int] | None] = (),
                    image_token_counts: Sequence[int] | None = None,
                    videos: Sequence[VideoPromptLayout] = ()) -> TokenizedPrompt:
        """Render chat messages with the checkpoint's chat template, then tokenize like HF does.

        Image parts are `{"type": "image"}` entries in a message's content list, in order. Raises
        PromptError for an empty chat, a role that is neither in CHAT_ROLES nor a CUSTOM_ROLE name, or
        content the template cannot render.
        """
        if not messages:
            raise PromptError("empty chat")
        part_types = VIDEO_CHAT_PART_TYPES if self.video_token is not None else CHAT_PART_TYPES
        for index, message in enumerate(messages):
            check_chat_message(index, message, part_types)
        try:
            text = self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001 - jinja's TemplateError (raise_exception) and its kin
            raise PromptError(f"the chat template cannot render these messages: {exc}") from None
        # HF's tokenizing chat path skips special tokens when the template already wrote BOS.
        bos = self.tokenizer.bos_token
        add_special = not (bos and text.startswith(bos))
        return self.encode_prompt(text, image_sizes, add_special_tokens=add_special,
                                  image_token_counts=image_token_counts, videos=videos)

    def _placeholders(self, ids: list[int], runs: list[list[int]],
                      found: Sequence[tuple[int, int]] = ()) -> list[PlaceholderRange]:
        # Runs of image tokens, split into runs of the expected lengths (adjacent images merge): one range
        # per run, in order, each naming its image (one run per image but for multi-run layouts).
        expected = [count for image_runs in runs for count in image_runs]
        if 0 not in expected and [n for _, n in found] == expected:
            it = iter(found)  # the runs as _repeat_runs wrote them: no scan of the expanded ids
            return [PlaceholderRange(next(it)[0], count, index)
                    for index, image_runs in enumerate(runs) for count in image_runs]
        positions = [i for i, t in enumerate(ids) if t == self.image_token_id]
        total = sum(sum(r) for r in runs)
        if len(positions) != total:
            raise PlaceholderMismatchError(
                f"tokenized prompt has {len(positions)} image tokens, expected {total}")
        out, k = [], 0
        for index, image_runs in enumerate(runs):
            for count in image_runs:
                span = positions[k:k + count]
                if span and span[-1] - span[0] != count - 1:
                    raise PlaceholderMismatchError(
                        f"image {index}: its placeholder tokens are not contiguous")
                out.append(PlaceholderRange(span[0] if span else 0, count, index))
                k += count
        return out

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of token ids."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def _one_per_run(video: VideoPromptLayout) -> VideoPromptLayout:
    """The same layout with one token per group (the text the tokenizer reads)."""
    return VideoPromptLayout(video.groups, 1, video.timestamps)


def check_chat_message(index: int, message: Any, part_types: frozenset[str] = CHAT_PART_TYPES) -> None:
    """Raise PromptError, naming message `index`, unless it is {"role": one of CHAT_ROLES, "content":
    a non-empty string or a list of {"type": "image"} / {"type": "text", "text": non-empty string}
    (and {"type": "video"} where part_types has it: Qwen-VL models)}."""
    if not isinstance(message, dict):
        raise PromptError(f"message {index}: not a mapping of role and content")
    role = message.get("role")
    if not isinstance(role, str) or not (role in CHAT_ROLES or CUSTOM_ROLE.fullmatch(role)):
        shown = repr(role)
        shown = shown if len(shown) <= 40 else shown[:37] + "..."  # the error text stays short
        raise PromptError(f"message {index}: unsupported role {shown}; use one of "
                          f"{', '.join(sorted(CHAT_ROLES))} or a custom role's name (a letter, then up to "
                          "63 letters, digits, '_', '.' or '-')")
    content = message.get("content")
    if isinstance(content, str):
        if not content:
            raise PromptError(f"message {index}: empty content")
        return
    if not isinstance(content, list):
        raise PromptError(f"message {index}: content must be a string or a list of parts")
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in AUDIO_PART_TYPES:
            raise PromptError(f"message {index} part {k}: audio input ({kind} parts) is not served; send "
                              "text and images only")
        if kind not in part_types:
            names = [t for t in ("text", "image", "video") if t in part_types]
            shown = " or ".join([", ".join(names[:-1]), names[-1]])
            raise PromptError(f"message {index} part {k}: not a {shown} part")
        if kind == "text" and (not isinstance(part.get("text"), str) or not part["text"]):
            raise PromptError(f"message {index} part {k}: text must be a non-empty string")
