"""Cache-aware routing (issue 67): a follow-up about an image goes where its conversation went, within a
load slack so that one hot image cannot pin a decoder; `user` as the fallback; least-outstanding
unchanged without the flag."""

from __future__ import annotations

from common.pb import common_pb2, decoder_pb2
from gateway.balancer import DecoderEndpoint, DecoderPool
from gateway.config import GatewayConfig
from gateway.routing import CacheAwareRouter, route_keys

PNG = b"\x89PNG fake bytes of one image"


def _chat(*turns: str, image: bytes | None = None, salt: str = "") -> decoder_pb2.GenerateRequest:
    """A conversation: the image in the first user turn, then the turns' texts."""
    messages = []
    for i, text in enumerate(turns):
        parts = [decoder_pb2.ContentPart(text=text)]
        if i == 0 and image is not None:
            parts.insert(0, decoder_pb2.ContentPart(image=common_pb2.ImageInput(data=image)))
        messages.append(decoder_pb2.ChatMessage(role="user" if i % 2 == 0 else "assistant", content=parts))
    return decoder_pb2.GenerateRequest(chat=decoder_pb2.ChatMessages(messages=messages), cache_salt=salt)


LONG = "Please look at this picture and describe every object in it, with colours and positions. " * 4


def _pool(n: int = 4, **router) -> tuple[DecoderPool, list[DecoderEndpoint]]:
    endpoints = [DecoderEndpoint(f"d{i}") for i in range(n)]
    return DecoderPool(endpoints, router=CacheAwareRouter(**router)), endpoints


def _send(pool: DecoderPool, request: decoder_pb2.GenerateRequest, user: str = "") -> DecoderEndpoint:
    keys = route_keys(request, user)
    chosen = pool.pick(keys=keys)
    pool.router.sent(chosen.address, keys)
    return chosen


def test_a_follow_up_turn_shares_its_conversation_prefix_chain():
    first = route_keys(_chat(LONG, image=PNG))
    follow = route_keys(_chat(LONG, "It shows a cat on a mat.", "And what colour is the cat?", image=PNG))
    assert first.prefix and follow.prefix[:len(first.prefix)] == first.prefix
    assert follow.media == first.media
    assert route_keys(_chat(LONG, image=PNG), "u").prefix == first.prefix
    other_tenant = route_keys(_chat(LONG, image=PNG, salt="tenant-b"))
    assert not set(other_tenant.prefix) & set(first.prefix) and other_tenant.media != first.media


def test_follow_ups_go_where_the_conversation_went():
    pool, endpoints = _pool()
    homes = {}
    for c in range(4):  # four conversations land on four decoders (least loaded while none is cached)
        chosen = _send(pool, _chat(f"conversation {c}: " + LONG, image=PNG + bytes([c])))
        chosen.outstanding += 1
        homes[c] = chosen
    assert len({e.address for e in homes.values()}) == 4
    for c in (2, 0, 3, 1):
        follow = _chat(f"conversation {c}: " + LONG, "an answer", "a second question", image=PNG + bytes([c]))
        assert _send(pool, follow) is homes[c]


def test_least_outstanding_would_have_scattered_them():
    endpoints = [DecoderEndpoint(f"d{i}") for i in range(4)]
    pool = DecoderPool(endpoints)  # no router: the flag's default
    endpoints[0].outstanding = 1
    assert pool.pick(keys=route_keys(_chat(LONG))) is not endpoints[0]


def test_one_hot_image_cannot_pin_a_decoder_beyond_the_slack():
    pool, endpoints = _pool(balance_abs=2, balance_rel=0.0)
    hot = _chat(LONG, image=PNG)
    home = _send(pool, hot)
    picks = []
    for _ in range(12):  # every request names the hot image and none finishes
        chosen = _send(pool, hot)
        chosen.outstanding += 1
        picks.append(chosen)
    assert picks[:3] == [home] * 3  # cached there, while within the slack
    loads = sorted(e.outstanding for e in endpoints)
    assert loads[-1] - loads[0] <= 3  # spread once the slack is used up


def test_user_is_the_fallback_when_nothing_is_cached():
    pool, _ = _pool()
    chosen = {_send(pool, _chat(f"short {i}"), user="alice").address for i in range(6)}
    assert len(chosen) == 1  # no prefix long enough to key: the same user, the same decoder


def test_a_gone_decoder_is_forgotten():
    router = CacheAwareRouter()
    keys = route_keys(_chat(LONG, image=PNG))
    router.sent("d0", keys)
    assert router.index("d0").score(keys) > 0
    router.forget("d0")
    assert router.index("d0").score(keys) == 0


def test_the_index_is_bounded():
    router = CacheAwareRouter(capacity=10)
    for i in range(50):
        router.sent("d0", route_keys(_chat(f"{i} " + LONG)))
    assert len(router.index("d0")) == 10


def test_the_flag_picks_the_router():
    assert DecoderPool.of(["127.0.0.1:1"]).router is None
    assert DecoderPool.of(["127.0.0.1:1"], routing="cache-aware").router is not None
    assert GatewayConfig(decoders=["127.0.0.1:1"]).routing == "least-outstanding"
