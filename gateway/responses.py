"""DecoderService output to OpenAI response bodies: whole responses, stream chunks, usage, logprobs."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from common.pb import decoder_pb2

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
FINISH_REASONS = {decoder_pb2.FINISH_REASON_STOP: "stop", decoder_pb2.FINISH_REASON_LENGTH: "length",
                  decoder_pb2.FINISH_REASON_ABORT: "abort"}


class TokenTexts:
    """Token ids to the text pieces OpenAI's logprobs show. Without a tokenizer (no --model given) a
    token is written `token_id:N`, as vLLM's return_tokens_as_token_ids does."""

    def __init__(self, model_dir: str | Path | None) -> None:
        self._tokenizer = None
        if model_dir is not None:
            from transformers import AutoTokenizer  # slow import: only when logprobs need text

            self._tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.text = lru_cache(maxsize=65536)(self._text)
        self.bytes = lru_cache(maxsize=65536)(self._bytes)

    def _text(self, token_id: int) -> str:
        if self._tokenizer is None:
            return f"token_id:{token_id}"
        return self._tokenizer.decode([token_id])

    def _bytes(self, token_id: int) -> list[int]:
        """The token's UTF-8 bytes; a byte-fallback token (`<0xE2>`, part of a character) is its one byte,
        where its text alone would read U+FFFD."""
        if self._tokenizer is not None:
            piece = self._tokenizer.convert_ids_to_tokens(token_id)
            match = _BYTE_TOKEN.fullmatch(piece or "")
            if match:
                return [int(match.group(1), 16)]
        return list(self.text(token_id).encode())


def summed_usage(usages: list[decoder_pb2.Usage | None], per_prompt: int | None = None) -> dict:
    """OpenAI's usage object for a request's choices (choice index order; None: a choice without its
    last message), with the decoder's prefix-cache hits as cached_tokens. As vLLM sums it: each prompt
    (and its cached tokens) once, as its first choice's call reports it, and every choice's tokens.
    per_prompt: the choices of each prompt (`n`; None: all choices share one prompt)."""
    per_prompt = per_prompt or max(len(usages), 1)
    prompt = cached = completion = 0
    for start in range(0, len(usages), per_prompt):
        given = [u for u in usages[start:start + per_prompt] if u is not None]
        if given:
            prompt += given[0].prompt_tokens
            cached += given[0].cached_prompt_tokens
        completion += sum(u.completion_tokens for u in given)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def chat_logprobs(chunk: decoder_pb2.GenerateResponse, top_n: int, texts: TokenTexts) -> list[dict]:
    """choice.logprobs.content entries for the chunk's tokens."""
    def entry(token_id: int, logprob: float) -> dict:
        text = texts.text(token_id)
        return {"token": text, "logprob": logprob, "bytes": texts.bytes(token_id)}

    return [{**entry(token_id, lp.logprob),
             "top_logprobs": [entry(i, v) for i, v in zip(lp.top_ids[:top_n], lp.top_logprobs[:top_n],
                                                           strict=True)]}
            for token_id, lp in zip(chunk.token_ids, chunk.logprobs, strict=False)]


@dataclass
class CompletionLogprobs:
    """The legacy completions logprobs object, built up chunk by chunk (text_offset runs on)."""

    top_n: int
    texts: TokenTexts
    offset: int = 0
    body: dict = field(default_factory=lambda: {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                                "text_offset": []})

    def add(self, chunk: decoder_pb2.GenerateResponse) -> dict:
        """Append the chunk's tokens; returns the part for these tokens alone (for a stream chunk)."""
        part = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, lp in zip(chunk.token_ids, chunk.logprobs, strict=False):
            text = self.texts.text(token_id)
            part["tokens"].append(text)
            part["token_logprobs"].append(lp.logprob)
            part["top_logprobs"].append(self._top(token_id, lp))
            part["text_offset"].append(self.offset)
            self.offset += len(text)
        for key, values in part.items():
            self.body[key].extend(values)
        return part

    def _top(self, token_id: int, lp: decoder_pb2.TokenLogprobs) -> dict[str, float]:
        """One position's top_logprobs: the sampled token, then the top_n most likely, as vLLM writes it
        (OpenAI: up to logprobs + 1 entries; `logprobs: 0` is the sampled token alone)."""
        top = {self.texts.text(token_id): lp.logprob}
        for i, v in zip(lp.top_ids[:self.top_n], lp.top_logprobs[:self.top_n], strict=True):
            top.setdefault(self.texts.text(i), v)
        return top


@dataclass
class ResponseHeader:
    """What every body of one response repeats."""

    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))


def chat_choice(index: int, text: str, finish: str | None, logprobs: list[dict] | None) -> dict:
    """One choice of a whole chat.completion."""
    return {"index": index, "message": {"role": "assistant", "content": text},
            "logprobs": None if logprobs is None else {"content": logprobs}, "finish_reason": finish}


def chat_completion(head: ResponseHeader, choices: list[dict], usage: dict) -> dict:
    """A whole chat.completion of chat_choice()s."""
    return {"id": head.id, "object": "chat.completion", "created": head.created, "model": head.model,
            "choices": choices, "usage": usage}


def chat_chunk(head: ResponseHeader, delta: dict, finish: str | None = None,
               logprobs: list[dict] | None = None, include_usage: bool = False,
               usage: dict | None = None, index: int = 0) -> dict:
    """One chat stream chunk of choice `index`; `usage` (continuous_usage_stats) is the usage so far."""
    body = {"id": head.id, "object": "chat.completion.chunk", "created": head.created, "model": head.model,
            "choices": [{"index": index, "delta": delta,
                         "logprobs": None if logprobs is None else {"content": logprobs},
                         "finish_reason": finish}]}
    if usage is not None:
        body["usage"] = usage
    elif include_usage:
        body["usage"] = None  # OpenAI: null on every chunk but the last, which carries it
    return body


def usage_chunk(head: ResponseHeader, obj: str, usage: dict) -> dict:
    return {"id": head.id, "object": obj, "created": head.created, "model": head.model, "choices": [],
            "usage": usage}


def completion_choice(index: int, text: str, finish: str | None, logprobs: dict | None) -> dict:
    """One choice of a text_completion (whole, or a stream chunk's)."""
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def completion(head: ResponseHeader, choices: list[dict], usage: dict | None, stream: bool = False,
               include_usage: bool = False) -> dict:
    """A text_completion body of completion_choice()s: the whole response, or (stream=True) one chunk."""
    body = {"id": head.id, "object": "text_completion", "created": head.created, "model": head.model,
            "choices": choices}
    if not stream or include_usage or usage is not None:
        body["usage"] = usage
    return body


class RunningUsage:
    """The usage so far of one streamed response, for continuous_usage_stats: completion tokens counted
    as they arrive; each prompt's tokens and cached tokens as the decoder last reported them (its first
    message, with the first token, and its last), summed over the prompts (several on /v1/completions)."""

    def __init__(self) -> None:
        self.completion_tokens = 0
        self.last: dict[int, decoder_pb2.Usage] = {}  # prompt index -> its latest usage

    def prime(self, messages: list[decoder_pb2.GenerateResponse | None], per_prompt: int | None = None
              ) -> None:
        """Take the prompts' counts from messages already received (the decoder's first message carries
        them) without counting their tokens, which add() counts when they are streamed. per_prompt: the
        choices of each prompt (None: all messages are of one prompt)."""
        for index, message in enumerate(messages):
            if message is not None and message.HasField("usage"):
                self.last[index // per_prompt if per_prompt else 0] = message.usage

    def add(self, chunk: decoder_pb2.GenerateResponse, prompt: int = 0) -> dict:
        """Count the chunk's tokens (of the request's prompt number `prompt`); the usage body after it."""
        self.completion_tokens += len(chunk.token_ids)
        if chunk.HasField("usage"):
            self.last[prompt] = chunk.usage
        return self.body()

    def body(self) -> dict:
        """The usage so far."""
        prompt = sum(u.prompt_tokens for u in self.last.values())
        cached = sum(u.cached_prompt_tokens for u in self.last.values())
        return {"prompt_tokens": prompt, "completion_tokens": self.completion_tokens,
                "total_tokens": prompt + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached}}
