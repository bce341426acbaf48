"""Admission before work: a request body read with a deadline and parsed with bounds, and the counts and
sizes of a request checked before any image is fetched or any decoder is called.

Each limit is named in its error (400 for counts and malformed input, 413 for sizes), never 429: a
request over a cap fails the same way every time, and a 429 would make clients retry it.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from starlette.requests import Request

from gateway.config import DECODER_MAX_SALT_BYTES, GatewayConfig, ImageFetchPolicy, RequestLimits
from gateway.errors import APIError, bad_request
from gateway.schemas import MAX_N, ChatCompletionRequest, CompletionRequest, ImagePart, VideoPart

# Bytes a chat template adds around each message (role markers, separators): what the rendered prompt
# costs beyond its text, so that a million empty messages count as what they are.
TEMPLATE_BYTES_PER_MESSAGE = 16
# One parse of a large body at a time, off the event loop: a huge body cannot starve small requests,
# and several cannot multiply the gateway's memory.
_PARSER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gateway-json")


def too_large(what: str, limit: int, unit: str, code: str = "request_too_large",
              param: str | None = None) -> APIError:
    """A 413 naming the limit."""
    return APIError(413, f"{what} exceeds the limit of {limit} {unit}", param=param, code=code)


class _TooManyValues(Exception):
    pass


def parse_json_bounded(body: bytes, max_values: int) -> object:
    """json.loads that stops at max_values objects and numbers (413) and turns malformed input, deep
    nesting and invalid UTF-8 into 400s."""
    count = 0

    def counted(value):
        nonlocal count
        count += 1
        if count > max_values:
            raise _TooManyValues()
        return value

    try:
        return json.loads(body, object_hook=counted, parse_int=lambda s: counted(int(s)),
                          parse_float=lambda s: counted(float(s)))
    except _TooManyValues:
        raise too_large("the request body's number of JSON objects and numbers", max_values,
                        "values") from None
    except RecursionError:
        raise bad_request("the request body's JSON is nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise bad_request(f"the request body is not valid JSON: {exc}") from None


async def read_json(request: Request, limits: RequestLimits, body_timeout_s: float) -> object:
    """The request's JSON body: declared and actual size checked against max_request_bytes as it
    arrives, read within body_timeout_s (408), and parsed with bounds (off the loop when large)."""
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json":  # a form, text or untyped body is not read as JSON
        given = f"unsupported Content-Type {media_type!r}" if media_type else "no Content-Type"
        raise APIError(415, f"{given}: send application/json", code="unsupported_media_type")
    limit = limits.max_request_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large("the request body", limit, "bytes")

    async def receive() -> bytes:
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_large("the request body", limit, "bytes")
        return bytes(body)

    try:
        data = await asyncio.wait_for(receive(), body_timeout_s)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {body_timeout_s:g} s",
                       code="request_timeout") from None
    if len(data) <= limits.parse_off_loop_bytes:
        return parse_json_bounded(data, limits.max_json_values)
    return await asyncio.get_running_loop().run_in_executor(
        _PARSER, partial(parse_json_bounded, data, limits.max_json_values))


def check_text(value: str, param: str) -> None:
    """400 for a string that is not valid Unicode text (a lone surrogate such as `\\ud800`)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(f"{param}: the text contains a lone UTF-16 surrogate, which is not valid "
                          "Unicode", param, "invalid_value") from None


def data_url_bytes(url: str) -> int:
    """The decoded size a data URL declares (its payload's length, base64 counted as 3/4 less padding)."""
    header, _, payload = url.partition(",")
    if header.endswith(";base64"):
        return max(len(payload) * 3 // 4 - payload[-2:].count("="), 0)
    return len(payload)


def admit_chat(req: ChatCompletionRequest, config: GatewayConfig) -> None:
    """Counts, text, rendered prompt size and declared image bytes of a chat request, before any fetch."""
    limits, images = config.limits, config.images
    if len(req.messages) > limits.max_messages:
        raise bad_request(f"{len(req.messages)} messages; at most {limits.max_messages} per request",
                          "messages", "too_many_messages")
    parts = n_images = n_videos = inline_bytes = 0
    prompt_bytes = TEMPLATE_BYTES_PER_MESSAGE * len(req.messages)
    for i, message in enumerate(req.messages):
        content = message.content
        if isinstance(content, str):
            check_text(content, f"messages.{i}.content")
            prompt_bytes += len(content.encode())
            parts += 1
            continue
        for j, part in enumerate(content or []):
            parts += 1
            if isinstance(part, ImagePart | VideoPart):
                n_images += isinstance(part, ImagePart)
                n_videos += isinstance(part, VideoPart)
                if part.url is not None and part.url.startswith("data:"):
                    inline_bytes += data_url_bytes(part.url)
            else:
                check_text(part.text, f"messages.{i}.content.{j}.text")
                prompt_bytes += len(part.text.encode())
    if parts > limits.max_content_parts:
        raise bad_request(f"{parts} content parts; at most {limits.max_content_parts} per request",
                          "messages", "too_many_content_parts")
    check_image_count(n_images, images)
    if n_videos > images.max_videos_per_request:
        raise bad_request(f"{n_videos} videos; at most {images.max_videos_per_request} per request",
                          "messages", "too_many_videos")
    if prompt_bytes > limits.max_prompt_bytes:
        raise too_large(f"the rendered prompt ({prompt_bytes} bytes with the template's share)",
                        limits.max_prompt_bytes, "bytes", "prompt_too_large", "messages")
    check_choice_images(n_images + n_videos, req.n, images)
    # One decoder call carries the bytes whatever n is (GenerateRequest.n; byte_budget.py).
    if inline_bytes > images.max_total_image_bytes:
        raise too_large(f"the request's data-URL images and videos ({inline_bytes} bytes)",
                        images.max_total_image_bytes, "bytes", "images_too_large", "messages")
    _admit_shared(req, config)


def check_image_count(n_images: int, images: ImageFetchPolicy) -> None:
    """400 naming the limit when a request carries too many images."""
    if n_images > images.max_images_per_request:
        raise bad_request(f"{n_images} images; at most {images.max_images_per_request} per request",
                          "messages", "too_many_images")


def check_choice_images(n_media: int, n: int, images: ImageFetchPolicy) -> None:
    """400 naming the limit when n choices of n_media images and videos each could never be admitted
    together by the decoder (its input processing takes max_images_all_choices at once): retrying would
    not help, so not a 429."""
    if n_media and n_media * n > images.max_images_all_choices:
        raise bad_request(f"n={n} choices of {n_media} images or videos each are {n_media * n}; at most "
                          f"{images.max_images_all_choices} per request, all choices together: lower n",
                          "n", "too_many_choice_images")


def admit_completion(req: CompletionRequest, config: GatewayConfig) -> None:
    """The prompts' text and size, and prompts x n choices, before the decoder is called."""
    several = isinstance(req.prompt, list) and bool(req.prompt) and not isinstance(req.prompt[0], int)
    if several and len(req.prompt) * req.n > MAX_N:
        raise bad_request(f"{len(req.prompt)} prompts x n={req.n} are {len(req.prompt) * req.n} choices; at "
                          f"most {MAX_N} per request", "prompt", "too_many_choices")
    prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
    prompts = [p for p in prompts if isinstance(p, str)]  # token ids: bounded by the body's value limit
    for i, prompt in enumerate(prompts):
        check_text(prompt, "prompt" if isinstance(req.prompt, str) else f"prompt.{i}")
    size = sum(len(p.encode()) for p in prompts)
    if size > config.limits.max_prompt_bytes:
        raise too_large(f"the prompt ({size} bytes)", config.limits.max_prompt_bytes, "bytes",
                        "prompt_too_large", "prompt")
    _admit_shared(req, config)


def _admit_shared(req: ChatCompletionRequest | CompletionRequest, config: GatewayConfig) -> None:
    for i, stop in enumerate(req.stop_list()):
        check_text(stop, f"stop.{i}" if isinstance(req.stop, list) else "stop")
    if req.cache_salt is not None:
        check_text(req.cache_salt, "cache_salt")


def check_salt(given: str, config: GatewayConfig) -> None:
    """400 naming the limit when the client's salt would be over the decoder's limit once the gateway's
    tenant prefix (and the decoder's tenant namespace, with a token upstream) is added to it."""
    limit, size = config.max_salt_bytes, len(given.encode())
    if size > limit:
        raise bad_request(
            f"cache_salt of {size} bytes is longer than the {limit} bytes allowed: the decoder's limit is "
            f"{DECODER_MAX_SALT_BYTES} bytes, and the gateway adds a tenant prefix of "
            f"{DECODER_MAX_SALT_BYTES - limit} bytes", "cache_salt", "invalid_value")
