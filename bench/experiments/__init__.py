"""One-off measurements, kept runnable but outside the suite (bench/run_gpu.sh and tests/bench call none of
them). Each module's docstring says how to run it; where its numbers are recorded:

- `encoder_memory`: the encoder's RSS after large images, with and without malloc_trim (RELIABILITY.md's
  table of hostile inputs).
- `video_decode_work`: frames decoded and CPU seconds of a long video with few sampled frames, and the host
  time of one served clip by part (RELIABILITY.md's table; README's video section).
- `empty_messages`: the gateway's time to refuse a million empty chat messages (RELIABILITY.md's table;
  tests/gateway/test_public_edge.py bounds the work, this the time).
- `security_overhead`: the per-RPC cost of TLS, mutual TLS and tokens. Its numbers are in no document: run
  it on the host in question.
- `vision_attention_nan`: where the Triton vision attention kernel's NaN on short spans comes from (poisoned
  outputs, tile variants; CUDA only). Findings in the closing note of 2026-12-06 and BENCHMARKS.md.
"""
