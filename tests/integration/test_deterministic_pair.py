"""Both services in the deterministic mode (`--deterministic` on the encoder and the decoder, what
`mmserve up --deterministic` starts): a greedy request's tokens and logprobs are the same bits alone, with
its image encoded while eight other requests' images queue beside it, served from the encoder's cache and
the decoder's prefix cache, and handed over as bytes (`--embedding-transports inline`) instead of shared
memory; nothing is left held. Qwen2.5-VL's tower: images of different sizes in one queue."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from common.images import encode_png
from tests.integration.harness import Pair, Service, free_port
from tests.oracle import make_image

PROMPT = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>what is in the picture? tell me more"
          "<|im_end|>\n<|im_start|>assistant\n")
OTHER = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>color?<|im_end|>\n"
         "<|im_start|>assistant\n")


def _reference(address: str, image: bytes, salt: str) -> tuple[list, list]:
    from common.client import DecoderClient

    with DecoderClient(address, timeout=300) as client:
        out = client.generate_text(PROMPT, [image], max_tokens=12, ignore_eos=True, logprobs=2,
                                   cache_salt=salt)
    return out.token_ids, [(lp.logprob, list(lp.top_ids), list(lp.top_logprobs)) for lp in out.logprobs]


def _other(address: str, image: bytes) -> None:
    from common.client import DecoderClient

    with DecoderClient(address, timeout=300) as client:
        client.generate_text(OTHER, [image], max_tokens=3)


def test_the_same_bits_alone_in_company_from_the_caches_and_over_bytes(qwen_model_dir, tmp_path):
    pair = Pair(qwen_model_dir, tmp_path, encoder_args=["--deterministic"],
                decoder_args=["--deterministic", "--max-num-batched-tokens", "48"])
    inline = Service("decoder-inline", ["decoder", "--model", str(qwen_model_dir), "--encoder",
                                        pair.encoder.address, "--deterministic", "--embedding-transports",
                                        "inline"], free_port(), tmp_path / "decoder-inline.log")
    ref_image = encode_png(make_image(7, (90, 120)))
    others = [encode_png(make_image(100 + i, (40 + 8 * i, 64))) for i in range(8)]
    pair.start()
    try:
        inline.start()
        alone = _reference(pair.decoder.address, ref_image, "alone")
        assert len(alone[0]) == 12 and len(alone[1]) == 12
        with ThreadPoolExecutor(9) as pool:
            company = [pool.submit(_other, pair.decoder.address, image) for image in others]
            among = pool.submit(_reference, pair.decoder.address, ref_image, "among")
            for f in company:
                f.result()
            assert among.result() == alone
        assert _reference(pair.decoder.address, ref_image, "alone") == alone  # both caches hit
        assert _reference(inline.address, ref_image, "bytes") == alone
        dec, enc = pair.wait_idle()
        assert dec.kv_blocks_used == 0 and dec.active_leases == 0 and enc.active_leases == 0
    finally:
        inline.stop()
        pair.stop()
