"""Image and video URLs of OpenAI requests to encoded bytes: `data:` URLs, and http(s) URLs fetched with a
timeout and a size limit (a video URL under the same policy as an image URL; its container is checked
from its first bytes instead of an image format).

Fetching a URL a client names is a server-side request forgery risk: by default every address the host
name resolves to must be a public one (not loopback, private, link-local, shared, reserved or
multicast), and the connection goes to the address that was checked (pinned, with the name kept for
the Host header and TLS), so a second DNS answer cannot point it elsewhere. Redirects are followed by
hand, each hop checked the same way.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import ipaddress
import socket
from collections.abc import Sequence
from urllib.parse import unquote_to_bytes

import httpx

from common.images import ImageError, check_image_format
from gateway.byte_budget import ByteBudget
from gateway.config import ImageFetchPolicy
from gateway.errors import bad_request

__all__ = ["ImageFetchPolicy", "ImageFetcher", "decode_data_url", "is_public_address"]

MAX_REDIRECTS = 3
# IPv6 ranges that carry an IPv4 address: judged by that address (NAT64 well-known prefix, RFC 6052), or
# refused whole (the local-use NAT64 prefix of RFC 8215, whose embedding depends on the operator's setup).
_NAT64_WELL_KNOWN = ipaddress.ip_network("64:ff9b::/96")
_NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")


def decode_data_url(url: str, max_bytes: int, param: str, kind: str = "image") -> bytes:
    """The bytes of a `data:[<mediatype>][;base64],<data>` URL (400 when malformed or too large); kind
    (image, video) names the content in messages."""
    header, sep, payload = url[len("data:"):].partition(",")
    if not sep:
        raise bad_request("malformed data URL: no ',' after the media type", param)
    if len(payload) > max_bytes * 4 // 3 + 4:  # cheap check before decoding
        raise bad_request(f"{kind} larger than {max_bytes} bytes", param, f"{kind}_too_large")
    if header.endswith(";base64"):
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise bad_request("malformed data URL: invalid base64", param) from None
    else:
        data = unquote_to_bytes(payload)
    if len(data) > max_bytes:
        raise bad_request(f"{kind} larger than {max_bytes} bytes", param, f"{kind}_too_large")
    if not data:
        raise bad_request(f"empty {kind} in data URL", param)
    return data


def embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address stands for: IPv4-mapped (::ffff:a.b.c.d), IPv4-compatible
    (::a.b.c.d), NAT64 (64:ff9b::a.b.c.d), 6to4 (2002:AABB:CCDD::) or Teredo's client; else None."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]
    if ip in _NAT64_WELL_KNOWN or (ip.packed[:12] == bytes(12) and int(ip) > 1):
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def is_public_address(address: str) -> bool:
    """Whether an IP address is a globally routable unicast address; an IPv6 address that embeds an IPv4
    one is judged by that IPv4 address, and the local-use NAT64 prefix is never public."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # drop an IPv6 zone id
    if isinstance(ip, ipaddress.IPv6Address):
        if ip in _NAT64_LOCAL:
            return False
        inner = embedded_ipv4(ip)
        if inner is not None:
            ip = inner
    return ip.is_global and not ip.is_multicast


async def _public_address(host: str, port: int, param: str, kind: str = "image") -> str:
    """The address to connect to for host: every address it resolves to must be public. kind (image,
    video) names the URL in messages."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise bad_request(f"cannot resolve {kind} URL host {host!r}: {exc.strerror}", param) from None
    addresses = [info[4][0] for info in infos]
    refused = [a for a in addresses if not is_public_address(a)]
    if refused or not addresses:
        raise bad_request(
            f"{kind} URL host {host!r} resolves to a non-public address "
            f"({refused[0] if refused else 'none'}); "
            "the gateway fetches only from public addresses unless started with --allow-private-image-urls",
            param, f"{kind}_url_forbidden")
    return addresses[0]


def check_video_container(data: bytes, param: str) -> None:
    """400 unless data starts like a video container the encoder reads (MP4/MOV, Matroska/WebM, AVI);
    the rest of the header is the encoder's to check (common/video/probe.py)."""
    from common.video.probe import sniff_format  # PyAV and the video stack load only when a video comes

    if sniff_format(data) is None:
        raise bad_request(f"{param}: not a video container the server reads (MP4/MOV, Matroska/WebM, AVI)",
                          param, "invalid_video_format")


class ImageFetcher:
    """Turns image URLs into bytes under an ImageFetchPolicy; one HTTP connection pool for all requests."""

    def __init__(self, policy: ImageFetchPolicy) -> None:
        self.policy = policy
        # trust_env=False: a proxy from the environment would bypass the address checks.
        self._client = httpx.AsyncClient(timeout=policy.timeout_s, follow_redirects=False, trust_env=False)
        self._slots = asyncio.Semaphore(policy.global_fetch_concurrency)  # the whole gateway's fetches

    async def close(self) -> None:
        await self._client.aclose()

    async def fetch_all(self, items: Sequence[tuple[str, str]], kinds: Sequence[str] | None = None,
                        budget: ByteBudget | None = None) -> list[bytes]:
        """The bytes of each (url, param), in order: at most fetch_concurrency at once for this request
        (and global_fetch_concurrency for the gateway), all within max_total_image_bytes (images and
        videos together). kinds: each item's "image" (default) or "video"; budget: the request's, when it
        holds its bytes against the gateway's budget. The first failure, or
        the caller's cancellation (a client that left), cancels the fetches still running."""
        budget = budget or ByteBudget(self.policy.max_total_image_bytes)
        mine = asyncio.Semaphore(self.policy.fetch_concurrency)

        async def one(url: str, param: str, kind: str) -> bytes:
            async with mine, self._slots:
                return await self.fetch(url, param, budget, kind)

        kinds = list(kinds) if kinds is not None else ["image"] * len(items)
        tasks = [asyncio.ensure_future(one(url, param, kind))
                 for (url, param), kind in zip(items, kinds, strict=True)]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in tasks:  # the failure first in request order, among those that ended
                if task in done and task.exception() is not None:
                    raise task.exception()
            return [task.result() for task in tasks]
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def fetch(self, url: str, param: str, budget: ByteBudget | None = None,
                    kind: str = "image") -> bytes:
        """The image (or, kind "video", video) bytes at url (data, http or https), format checked from the
        header; an APIError (400, or 413 past the budget) names `param` on failure."""
        budget = budget or ByteBudget(self.policy.max_total_image_bytes)
        if url.startswith("data:"):
            data = decode_data_url(url, self.policy.max_file_bytes(kind), param, kind)
            budget.take(len(data), param)
        else:
            data = await self._fetch_url(url, param, budget, kind)
        if kind == "video":
            check_video_container(data, param)
            return data
        try:
            check_image_format(data, self.policy.format_names)
        except ImageError as exc:
            raise bad_request(f"{param}: {exc}", param, "invalid_image_format") from None
        return data

    async def _fetch_url(self, url: str, param: str, budget: ByteBudget, kind: str = "image") -> bytes:
        try:
            return await asyncio.wait_for(self._fetch_http(url, param, budget, kind), self.policy.timeout_s)
        except (asyncio.TimeoutError, httpx.TimeoutException):
            raise bad_request(f"timed out after {self.policy.timeout_s:g} s fetching the {kind} URL",
                              param, f"{kind}_fetch_timeout") from None
        except httpx.HTTPError as exc:
            raise bad_request(f"cannot fetch the {kind} URL: {type(exc).__name__}: {exc}", param,
                              f"{kind}_fetch_failed") from None

    async def _fetch_http(self, url: str, param: str, budget: ByteBudget, kind: str = "image") -> bytes:
        for _ in range(MAX_REDIRECTS + 1):
            try:
                target = httpx.URL(url)
            except httpx.InvalidURL as exc:
                raise bad_request(f"invalid {kind} URL: {exc}", param) from None
            if target.scheme not in ("http", "https") or not target.host:
                raise bad_request(f"{kind}_url must be a data:, http: or https: URL", param)
            request = self._request(target, await self._connect_to(target, param, kind))
            response = await self._client.send(request, stream=True)
            try:
                if response.is_redirect and "location" in response.headers:
                    url = str(target.join(response.headers["location"]))
                    continue
                if response.status_code != 200:
                    raise bad_request(f"fetching the {kind} URL answered HTTP {response.status_code}", param,
                                      f"{kind}_fetch_failed")
                return await self._read_limited(response, param, budget, kind)
            finally:
                await response.aclose()
        raise bad_request(f"more than {MAX_REDIRECTS} redirects fetching the {kind} URL", param,
                          f"{kind}_fetch_failed")

    async def _connect_to(self, target: httpx.URL, param: str, kind: str = "image") -> str | None:
        """The checked address to pin the connection to (None: let the client resolve, when allowed)."""
        if self.policy.allow_private:
            return None
        return await _public_address(target.host, target.port or (443 if target.scheme == "https" else 80),
                                     param, kind)

    def _request(self, target: httpx.URL, address: str | None) -> httpx.Request:
        if address is None:
            return self._client.build_request("GET", target)
        # Connect to the checked address; keep the name for Host and for TLS (SNI and certificate check).
        pinned = target.copy_with(host=address)
        headers = {"Host": target.netloc.decode("ascii")}
        extensions = {"sni_hostname": target.host} if target.scheme == "https" else {}
        return self._client.build_request("GET", pinned, headers=headers, extensions=extensions)

    async def _read_limited(self, response: httpx.Response, param: str, budget: ByteBudget,
                            kind: str = "image") -> bytes:
        """The body, refused (before it is all read) past the per-file limit or the request's budget."""
        limit = self.policy.max_file_bytes(kind)
        declared = response.headers.get("content-length")
        if declared is not None and declared.isdigit():
            if int(declared) > limit:
                raise bad_request(f"{kind} larger than {limit} bytes", param, f"{kind}_too_large")
            budget.check_declared(int(declared), param)
        chunks, size = [], 0
        async for chunk in response.aiter_bytes():
            budget.take(len(chunk), param)
            size += len(chunk)
            if size > limit:
                raise bad_request(f"{kind} larger than {limit} bytes", param, f"{kind}_too_large")
            chunks.append(chunk)
        if not size:
            raise bad_request(f"the {kind} URL returned no bytes", param)
        return b"".join(chunks)
