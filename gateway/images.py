"""Image URLs of OpenAI requests to encoded image bytes: `data:` URLs, and http(s) URLs fetched with a
timeout and a size limit.

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
from dataclasses import dataclass
from urllib.parse import unquote_to_bytes

import httpx

from gateway.errors import bad_request

MAX_REDIRECTS = 3


@dataclass(frozen=True)
class ImageFetchPolicy:
    """Limits on the images a request may name."""

    max_bytes: int = 20 * 2**20
    timeout_s: float = 10.0
    allow_private: bool = False  # --allow-private-image-urls: also fetch from loopback/private hosts


def decode_data_url(url: str, max_bytes: int, param: str) -> bytes:
    """The bytes of a `data:[<mediatype>][;base64],<data>` URL (400 when malformed or too large)."""
    header, sep, payload = url[len("data:"):].partition(",")
    if not sep:
        raise bad_request("malformed data URL: no ',' after the media type", param)
    if len(payload) > max_bytes * 4 // 3 + 4:  # cheap check before decoding
        raise bad_request(f"image larger than {max_bytes} bytes", param, "image_too_large")
    if header.endswith(";base64"):
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise bad_request("malformed data URL: invalid base64", param) from None
    else:
        data = unquote_to_bytes(payload)
    if len(data) > max_bytes:
        raise bad_request(f"image larger than {max_bytes} bytes", param, "image_too_large")
    if not data:
        raise bad_request("empty image in data URL", param)
    return data


def is_public_address(address: str) -> bool:
    """Whether an IP address is a globally routable unicast address (IPv4-mapped IPv6 unwrapped)."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # drop an IPv6 zone id
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


async def _public_address(host: str, port: int, param: str) -> str:
    """The address to connect to for host: every address it resolves to must be public."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise bad_request(f"cannot resolve image URL host {host!r}: {exc.strerror}", param) from None
    addresses = [info[4][0] for info in infos]
    refused = [a for a in addresses if not is_public_address(a)]
    if refused or not addresses:
        raise bad_request(
            f"image URL host {host!r} resolves to a non-public address "
            f"({refused[0] if refused else 'none'}); "
            "the gateway fetches only from public addresses unless started with --allow-private-image-urls",
            param, "image_url_forbidden")
    return addresses[0]


class ImageFetcher:
    """Turns image URLs into bytes under an ImageFetchPolicy; one HTTP connection pool for all requests."""

    def __init__(self, policy: ImageFetchPolicy) -> None:
        self.policy = policy
        # trust_env=False: a proxy from the environment would bypass the address checks.
        self._client = httpx.AsyncClient(timeout=policy.timeout_s, follow_redirects=False, trust_env=False)

    async def close(self) -> None:
        await self._client.aclose()

    async def fetch(self, url: str, param: str) -> bytes:
        """The image bytes at url (data, http or https); an APIError (400) names `param` on failure."""
        if url.startswith("data:"):
            return decode_data_url(url, self.policy.max_bytes, param)
        try:
            return await asyncio.wait_for(self._fetch_http(url, param), self.policy.timeout_s)
        except (asyncio.TimeoutError, httpx.TimeoutException):
            raise bad_request(f"timed out after {self.policy.timeout_s:g} s fetching the image URL",
                              param, "image_fetch_timeout") from None
        except httpx.HTTPError as exc:
            raise bad_request(f"cannot fetch the image URL: {type(exc).__name__}: {exc}", param,
                              "image_fetch_failed") from None

    async def _fetch_http(self, url: str, param: str) -> bytes:
        for _ in range(MAX_REDIRECTS + 1):
            try:
                target = httpx.URL(url)
            except httpx.InvalidURL as exc:
                raise bad_request(f"invalid image URL: {exc}", param) from None
            if target.scheme not in ("http", "https") or not target.host:
                raise bad_request("image_url must be a data:, http: or https: URL", param)
            request = self._request(target, await self._connect_to(target, param))
            response = await self._client.send(request, stream=True)
            try:
                if response.is_redirect and "location" in response.headers:
                    url = str(target.join(response.headers["location"]))
                    continue
                if response.status_code != 200:
                    raise bad_request(f"fetching the image URL answered HTTP {response.status_code}", param,
                                      "image_fetch_failed")
                return await self._read_limited(response, param)
            finally:
                await response.aclose()
        raise bad_request(f"more than {MAX_REDIRECTS} redirects fetching the image URL", param,
                          "image_fetch_failed")

    async def _connect_to(self, target: httpx.URL, param: str) -> str | None:
        """The checked address to pin the connection to (None: let the client resolve, when allowed)."""
        if self.policy.allow_private:
            return None
        return await _public_address(target.host, target.port or (443 if target.scheme == "https" else 80),
                                     param)

    def _request(self, target: httpx.URL, address: str | None) -> httpx.Request:
        if address is None:
            return self._client.build_request("GET", target)
        # Connect to the checked address; keep the name for Host and for TLS (SNI and certificate check).
        pinned = target.copy_with(host=address)
        headers = {"Host": target.netloc.decode("ascii")}
        extensions = {"sni_hostname": target.host} if target.scheme == "https" else {}
        return self._client.build_request("GET", pinned, headers=headers, extensions=extensions)

    async def _read_limited(self, response: httpx.Response, param: str) -> bytes:
        limit = self.policy.max_bytes
        declared = response.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise bad_request(f"image larger than {limit} bytes", param, "image_too_large")
        chunks, size = [], 0
        async for chunk in response.aiter_bytes():
            size += len(chunk)
            if size > limit:
                raise bad_request(f"image larger than {limit} bytes", param, "image_too_large")
            chunks.append(chunk)
        if not size:
            raise bad_request("the image URL returned no bytes", param)
        return b"".join(chunks)
