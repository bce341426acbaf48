"""The encoder service: images to LLaVA image embeddings, cached by content hash, handed out zero-copy.

- `vision.VisionEncoder`: vision tower + projector only, equal to HF `get_image_features`.
- `cache.EmbeddingCache`: byte-bounded LRU over an arena, leases with a TTL, in-flight dedup.
- `worker.VisionWorker`: one thread, demand before prefetch, batches per priority (CUDA streams).
- `server.EncoderServicer`: the gRPC API; `main.run(args)` / `python -m encoder_svc` start it.
"""
