"""The pair as real processes with TLS and tokens: the decoder serves TLS to token-bearing clients, and
reaches its encoder over mutual TLS as the `decoder` service identity. Tenants share nothing."""

from __future__ import annotations

import grpc
import pytest

from common.checkpoint import model_fingerprint
from common.client import DecoderClient, EncoderClient
from common.families.llava.oracle import LlavaOracle
from common.hashing import hash_image_file
from common.images import encode_png
from common.security.identity import scoped_salt
from common.security.tls import ClientTls
from tests.integration.harness import Pair
from tests.oracle import make_image
from tests.security.conftest import ALICE, BOB

PROMPT = "USER: <image>\nWhat is in this picture? Describe it in a few words. ASSISTANT:"
N = 6


@pytest.fixture(scope="module")
def secure_pair(tiny_model_dir, tmp_path_factory, pki, tokens_file):
    decoder_cert, decoder_key = pki.clients["decoder"]
    client_cert, client_key = pki.clients["client"]
    pair = Pair(
        tiny_model_dir, tmp_path_factory.mktemp("secure-pair"),
        encoder_args=["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
                      "--tls-client-ca", str(pki.ca_cert), "--auth-tokens", str(tokens_file),
                      "--auth-cert-service", "decoder"],
        decoder_args=["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
                      "--auth-tokens", str(tokens_file), "--encoder-tls-ca", str(pki.ca_cert),
                      "--encoder-tls-cert", str(decoder_cert), "--encoder-tls-key", str(decoder_key),
                      "--num-kv-blocks", "256", "--encoder-timeout", "10"])
    pair.encoder.health_tls = ClientTls.from_files(pki.ca_cert, client_cert, client_key)
    pair.decoder.health_tls = ClientTls.from_files(pki.ca_cert)
    pair.start()
    yield pair
    pair.stop()


@pytest.fixture(scope="module")
def oracle(tiny_model_dir) -> LlavaOracle:
    return LlavaOracle(tiny_model_dir)


def _decoder(pair, pki, token: str | None) -> DecoderClient:
    return DecoderClient(pair.decoder.address, timeout=120, tls=ClientTls.from_files(pki.ca_cert),
                         token=token)


def test_no_token_is_unauthenticated_and_plaintext_is_refused(secure_pair, pki):
    with _decoder(secure_pair, pki, None) as client, pytest.raises(grpc.RpcError) as err:
        client.generate_text("USER: hi ASSISTANT:", max_tokens=2)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with DecoderClient(secure_pair.decoder.address, timeout=10, token=ALICE) as plain, \
            pytest.raises(grpc.RpcError) as err:
        plain.generate_text("USER: hi ASSISTANT:", max_tokens=2)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_tenants_share_no_prefix_kv_and_no_embeddings(secure_pair, pki, oracle):
    image = make_image(81)
    with _decoder(secure_pair, pki, ALICE) as alice, _decoder(secure_pair, pki, BOB) as bob:
        first = alice.generate_text(PROMPT, [encode_png(image)], max_tokens=N, cache_salt="s")
        oracle.assert_same_tokens(first.token_ids, PROMPT, [image], N)
        again = alice.generate_text(PROMPT, [encode_png(image)], max_tokens=N, cache_salt="s")
        assert again.usage.cached_prompt_tokens > 0  # the same tenant does reuse its prefix
        # Bob sends the very same prompt, image and salt: nothing of Alice's is reused.
        other = bob.generate_text(PROMPT, [encode_png(image)], max_tokens=N, cache_salt="s")
        assert other.usage.cached_prompt_tokens == 0
        assert other.usage.images_encoder_cache_hits == 0
        assert other.token_ids == first.token_ids  # and it is still the right answer


def test_a_tenant_cannot_use_another_tenants_image_hash(secure_pair, pki, tiny_model_dir):
    image = make_image(82)
    with _decoder(secure_pair, pki, ALICE) as alice, _decoder(secure_pair, pki, BOB) as bob:
        alice.generate_text(PROMPT, [encode_png(image)], max_tokens=2)
        fingerprint = model_fingerprint(tiny_model_dir)
        digest = hash_image_file(encode_png(image), fingerprint, scoped_salt("alice", ""))
        assert alice.generate_text(PROMPT, [f"hash:{digest}"], max_tokens=2).usage.images == 1
        with pytest.raises(grpc.RpcError) as err:
            bob.generate_text(PROMPT, [f"hash:{digest}"], max_tokens=2)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_the_link_leaves_no_leases(secure_pair, pki):
    cert, key = pki.clients["client"]
    with EncoderClient(secure_pair.encoder.address, timeout=10, token=ALICE,
                       tls=ClientTls.from_files(pki.ca_cert, cert, key)) as encoder:
        stats = encoder.stats()
    assert stats.active_leases == 0 and stats.encodes > 0
