"""The encoder service: images and videos to a model's embeddings, cached by content hash, handed out
zero-copy.

- the checkpoint's `VisionEncoder` (common/families/encoder.py, made by its family): vision tower +
  projector only, equal to HF `get_image_features`.
- `cache.EmbeddingCache`: byte-bounded LRU over an arena, leases with a TTL, in-flight dedup.
- `pixels.TorchPixelProcessor`: the checkpoint's image processor as torch ops (GPU preprocessing).
- `worker.VisionWorker`: a preprocessing pool and one tower thread, demand before prefetch, batches
  per priority that follow the queue (CUDA streams).
- `server.EncoderServicer`: the gRPC API; `main.main(argv)` / `python -m encoder_svc` start it.
"""
