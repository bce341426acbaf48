"""OpenAI requests to DecoderService GenerateRequests.

Sampling follows OpenAI's defaults where the decoder's differ: an omitted `temperature` is 1.0 (the
decoder's 0 means greedy), an omitted `max_tokens` is the server's default for chat and 16 for
completions. vLLM's `min_tokens` passes through; `n` goes to the decoder with the prompt (one request for
n samples: the image sent and the prompt prefilled once), and a list of prompts becomes one request per
prompt (DecoderCalls), so that different prompts never share a prefill. What the decoder cannot do
(penalties, tools, legacy functions, structured output, other output modalities, echo, suffix, best_of) is
refused with a 400 naming the parameter rather than silently ignored.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from common.pb import common_pb2, decoder_pb2
from gateway.byte_budget import ByteBudget
from gateway.errors import APIError, bad_request
from gateway.images import ImageFetcher
from gateway.media_memo import MediaMemo, TenantMedia
from gateway.schemas import ChatCompletionRequest, CompletionRequest, ImagePart, TextPart, VideoPart

MAX_STOP_STRINGS = 4  # OpenAI's limit
IMAGE_MARKER = "<image>"  # the decoder's placeholder in a text prompt
_ROLE = {"developer": "system"}  # OpenAI's newer name for the system role


def _refuse_unsupported(req: ChatCompletionRequest | CompletionRequest) -> None:
    if req.stream_options is not None and not req.stream:  # vLLM's rule
        raise bad_request("stream_options can only be given when stream is true", "stream_options",
                          "invalid_value")
    max_tokens = req.max_tokens
    if isinstance(req, ChatCompletionRequest):
        max_tokens = req.max_completion_tokens or req.max_tokens
    if max_tokens is not None and req.min_tokens > max_tokens:  # vLLM's rule
        raise bad_request(f"min_tokens ({req.min_tokens}) must be at most max_tokens ({max_tokens})",
                          "min_tokens", "invalid_value")
    if req.frequency_penalty or req.presence_penalty:
        param = "frequency_penalty" if req.frequency_penalty else "presence_penalty"
        raise bad_request(f"{param} is not supported", param, "unsupported_parameter")
    if req.logit_bias:
        raise unsupported("logit_bias")
    kind = (req.response_format or {}).get("type", "text")
    if req.response_format is not None and kind != "text":
        raise unsupported("response_format", f"response_format {kind!r} is not supported: the server has "
                          'no structured output; only {"type": "text"} is served')
    if len(req.stop_list()) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop sequences", "stop", "invalid_value")


def unsupported(param: str, message: str | None = None) -> APIError:
    """The 400 for a parameter the server does not honour (naming it), rather than silently ignoring it."""
    return bad_request(message or f"{param} is not supported", param, "unsupported_parameter")


def _refuse_unhonoured_chat(req: ChatCompletionRequest) -> None:
    """Chat fields OpenAI defines that the server does not honour: tools, the legacy functions (and a
    function_call other than "none"), output modalities other than text, media_io_kwargs."""
    if req.tools:
        raise unsupported("tools")
    if req.functions:
        raise unsupported("functions", "functions (the legacy form of tools) are not supported")
    if req.function_call not in (None, "none"):
        raise unsupported("function_call", 'function_call is not supported (only "none")')
    if req.modalities is not None and any(m != "text" for m in req.modalities):
        raise unsupported("modalities", 'modalities: only "text" output is served')
    if req.media_io_kwargs:
        raise unsupported("media_io_kwargs", "media_io_kwargs is not supported: choose how a video is "
                          "sampled with mm_processor_kwargs' fps and max_frames")


def sampling_params(req: ChatCompletionRequest | CompletionRequest, max_tokens: int | None,
                    logprobs: int) -> decoder_pb2.SamplingParams:
    """SamplingParams for the decoder from the shared OpenAI fields."""
    params = decoder_pb2.SamplingParams(
        max_tokens=max_tokens or 0,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=0.0 if req.top_p is None or req.top_p >= 1.0 else req.top_p,
        top_k=max(req.top_k or 0, 0),  # vLLM's -1 means off, as the decoder's 0 does
        stop=req.stop_list(), ignore_eos=req.ignore_eos, logprobs=logprobs, min_tokens=req.min_tokens)
    if req.seed is not None:
        params.seed = req.seed % 2**64  # a negative seed (vLLM's -1 too) as its two's complement
    return params


def chat_logprobs_wanted(req: ChatCompletionRequest) -> int:
    """How many top alternatives the decoder must send per token (at least 1 when logprobs are on: the
    decoder sends the sampled token's logprob only alongside its top N)."""
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs", "invalid_value")
    return max(req.top_logprobs or 0, 1) if req.logprobs else 0


async def chat_request(req: ChatCompletionRequest, fetcher: ImageFetcher, cache_salt: str,
                       takes_video: bool | None = None, budget: ByteBudget | None = None,
                       memo: MediaMemo | TenantMedia | None = None) -> decoder_pb2.GenerateRequest:
    """A chat GenerateRequest; image and video URLs are fetched with bounded concurrency
    (ImageFetcher.fetch_all), each error naming its part. The request's counts and sizes were admitted
    before (admission.py). A video_url part becomes a chat video part (VideoInput with the model's
    default sampling); takes_video False (a served model without video input, e.g. LLaVA) refuses it
    with a 400 before anything is fetched, None leaves the decision to the decoder. budget: the request's
    byte budget (each byte counted once per choice), the fetcher's default without one. memo: the files
    clients named by vLLM's `uuid` (media_memo.py: the tenant's); without one, a uuid-only part is a 400."""
    _refuse_unsupported(req)
    _refuse_unhonoured_chat(req)
    out = decoder_pb2.GenerateRequest(
        request_id=f"chatcmpl-{uuid.uuid4().hex}", cache_salt=cache_salt,
        sampling=sampling_params(req, req.max_completion_tokens or req.max_tokens, chat_logprobs_wanted(req)))
    fetches: list[MediaPart] = []
    for i, message in enumerate(req.messages):
        chat_message = out.chat.messages.add(role=_ROLE.get(message.role, message.role))
        parts = [TextPart(type="text", text=message.content)] if isinstance(message.content, str) else (
            message.content or [])
        for j, part in enumerate(parts):
            if isinstance(part, ImagePart):
                if message.role == "assistant":  # system and custom roles may, as in vLLM
                    raise bad_request("assistant messages cannot carry images", f"messages.{i}.content.{j}")
                image = chat_message.content.add().image
                fetches.append(MediaPart(image, part.url, f"messages.{i}.content.{j}.image_url", "image",
                                         part.uuid))
            elif isinstance(part, VideoPart):
                param = f"messages.{i}.content.{j}.video_url"
                if takes_video is False:
                    raise bad_request("this model does not take video input (video_url parts); send text "
                                      "and images only", param, "unsupported_modality")
                if message.role == "assistant":
                    raise bad_request("assistant messages cannot carry videos", f"messages.{i}.content.{j}")
                video = chat_message.content.add().video
                fetches.append(MediaPart(video, part.url, param, "video", part.uuid))
            else:
                chat_message.content.add(text=part.text)
    _apply_processor_kwargs(req, fetches, takes_video)
    if fetches:
        budget = budget or ByteBudget(fetcher.policy.max_total_image_bytes)
        await _fill_media(fetches, fetcher, cache_salt, budget, memo)
    return out


@dataclass
class MediaPart:
    """An image or video of a chat request: the message field to fill, where its bytes come from (a URL,
    or the uuid of a file sent before), the parameter that names it in errors."""

    item: common_pb2.ImageInput | common_pb2.VideoInput
    url: str | None
    param: str
    kind: str  # "image" or "video"
    uuid: str | None = None


async def _fill_media(parts: list[MediaPart], fetcher: ImageFetcher, salt: str, budget: ByteBudget,
                      memo: MediaMemo | TenantMedia | None) -> None:
    """Each part's bytes: a uuid-only part from the tenant's memo (400 when it holds no such file), the
    others fetched (a named one then remembered). Every byte counts against the request's budget."""
    for part in parts:
        if part.url is None:
            data = memo.get(salt, part.kind, part.uuid) if memo is not None else None
            param = part.param.rpartition(".")[0] + ".uuid"
            if data is None:
                raise bad_request(f"no {part.kind} named {part.uuid!r} is known here (never sent, or "
                                  f"forgotten since): send it again with its {part.kind}_url", param,
                                  f"unknown_{part.kind}_uuid")
            budget.take(len(data), param)
            part.item.data = data
    fetched = [part for part in parts if part.url is not None]
    if fetched:
        datas = await fetcher.fetch_all([(p.url, p.param) for p in fetched], [p.kind for p in fetched],
                                        budget)
        for part, data in zip(fetched, datas, strict=True):
            part.item.data = data
            if part.uuid is not None and memo is not None:
                memo.put(salt, part.kind, part.uuid, data)


def _apply_processor_kwargs(req: ChatCompletionRequest, items: list[MediaPart],
                            takes_video: bool | None) -> None:
    """mm_processor_kwargs onto every image (its pixel range, its pan-and-scan choice) and video (pixel
    range and sampling) of the request; a 400 for pixel or video settings on a model whose images have a
    fixed size (LLaVA, Gemma 3), where none of them means anything. do_pan_and_scan goes to every image
    as it is: the decoder refuses true on a model without crops (INVALID_ARGUMENT naming the image)."""
    kwargs = req.mm_processor_kwargs
    if kwargs is None:
        return
    if kwargs.do_pan_and_scan is not None:
        for part in items:
            if isinstance(part.item, common_pb2.ImageInput):
                part.item.pan_and_scan = kwargs.do_pan_and_scan
    if not kwargs.given:
        return
    if takes_video is False:
        raise bad_request("mm_processor_kwargs: this model's images have a fixed size and it takes no "
                          "video; the settings apply to models that resize images into a pixel range",
                          "mm_processor_kwargs", "unsupported_parameter")
    for part in items:
        item = part.item
        item.min_pixels, item.max_pixels = kwargs.min_pixels or 0, kwargs.max_pixels or 0
        if isinstance(item, common_pb2.VideoInput):
            item.fps, item.max_frames = kwargs.fps or 0.0, kwargs.max_frames or 0


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """The request's prompts: one (a string or token ids), or vLLM's list of strings or of id lists."""
    prompt = req.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt:
        raise bad_request("empty prompt", "prompt", "invalid_value")
    return list(prompt)


def completion_calls(req: CompletionRequest, cache_salt: str) -> DecoderCalls:
    """One GenerateRequest per prompt, each of a text prompt or of token ids (no images: chat
    completions carry those); with several prompts the n-th is `ID-n`."""
    _refuse_unsupported(req)
    if req.echo:
        raise unsupported("echo")
    if req.suffix:
        raise unsupported("suffix")
    if req.best_of not in (None, 1):
        raise bad_request("best_of > 1 is not supported", "best_of", "unsupported_value")
    prompts = completion_prompts(req)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    # logprobs 0 still asks for the sampled tokens' logprobs: the decoder sends those with its top 1.
    sampling = sampling_params(req, req.max_tokens, 0 if req.logprobs is None else max(req.logprobs, 1))
    out = []
    for index, prompt in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt.{index}"
        one = decoder_pb2.GenerateRequest(
            request_id=request_id if len(prompts) == 1 else f"{request_id}-{index}", cache_salt=cache_salt,
            sampling=sampling)
        if not prompt:
            raise bad_request("empty prompt", param, "invalid_value")
        if isinstance(prompt, list):  # token ids (vLLM's): the decoder checks them against the vocabulary
            one.prompt_token_ids.ids.extend(prompt)
        elif IMAGE_MARKER in prompt:
            raise bad_request(f"the completions endpoint takes text only ({IMAGE_MARKER!r} found); send "
                              "images through /v1/chat/completions", param, "invalid_value")
        else:
            one.prompt = prompt
        out.append(one)
    return DecoderCalls(request_id, out)


def completion_request(req: CompletionRequest, cache_salt: str) -> decoder_pb2.GenerateRequest:
    """The GenerateRequest of a one-prompt completions request (400 for several: completion_calls)."""
    calls = completion_calls(req, cache_salt)
    if len(calls.prompts) != 1:
        raise bad_request("exactly one prompt here", "prompt", "unsupported_value")
    return calls.prompts[0]


@dataclass
class DecoderCalls:
    """What one OpenAI request asks of the decoders: the response's id, and one GenerateRequest per
    prompt (chat: one; completions: one per prompt), each asking for `n` samples."""

    request_id: str
    prompts: list[decoder_pb2.GenerateRequest]

    def choices(self, n: int, lora_adapter: str = "") -> list[decoder_pb2.GenerateRequest]:
        """Every decoder request, one per prompt, each for n samples (GenerateRequest.n; the decoder's
        choice i seeds with seed + i, as fan_out's i-th request did): choice `index` = prompt x n +
        sample, as OpenAI and vLLM number a list of prompts' choices (gateway/choices.py)."""
        for prompt in self.prompts:
            prompt.lora_adapter = lora_adapter
            if n > 1:
                prompt.n = n
        return list(self.prompts)


def fan_out(request: decoder_pb2.GenerateRequest, n: int) -> list[decoder_pb2.GenerateRequest]:
    """The n separate decoder requests equivalent to one request for n samples: the same prompt and
    sampling, ids `ID-0`..`ID-(n-1)` and, as vLLM gives its parallel samples, seeds seed+0..seed+(n-1), so
    seeded choices differ from each other yet repeat from call to call. n == 1 is the request itself.
    The gateway sends n instead (DecoderCalls.choices); this is the reference its samples must match
    (tests) and the form for a decoder without GenerateRequest.n."""
    if n == 1:
        return [request]
    out = []
    for i in range(n):
        child = decoder_pb2.GenerateRequest()
        child.CopyFrom(request)
        child.request_id = f"{request.request_id}-{i}"
        if request.sampling.HasField("seed"):
            child.sampling.seed = (request.sampling.seed + i) % 2**64
        out.append(child)
    return out
