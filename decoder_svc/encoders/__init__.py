"""The decoder's side of its encoders: the gRPC client that fetches embeddings (remote_source.py, an
EmbeddingSource the engine sees only through that protocol), consistent-hash routing (routing.py) and
discovery of encoder replicas by DNS (discovery.py)."""
