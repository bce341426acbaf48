"""The decoder's side of its encoders: the gRPC client that fetches embeddings (remote_source.py, an
EmbeddingSource the engine sees only through that protocol) and its parts: how long to keep asking
(retry_policy.py), leases (leases.py), which transports to ask each encoder for (transport_choice.py),
what an Encode carries (encode_items.py), the copy onto the GPU (side_stream.py), the per-image state
(fetch_slot.py), the embeddings kept for later requests with the same image (retained.py) and counters
(source_stats.py); consistent-hash routing (routing.py) and discovery of
encoder replicas by DNS (discovery.py)."""
