"""Our Llama-family language model over a paged KV cache."""

from decoder_svc.model.attention import AttentionBackend, AttentionMetadata, TorchAttentionBackend
from decoder_svc.model.config import TextModelConfig
from decoder_svc.model.kv_cache import KVCacheSpec, allocate_kv_cache
from decoder_svc.model.llama import LlamaForCausalLM
from decoder_svc.model.loader import generation_eos_ids, load_language_model

__all__ = ["AttentionBackend", "AttentionMetadata", "KVCacheSpec", "LlamaForCausalLM", "TextModelConfig",
           "TorchAttentionBackend", "allocate_kv_cache", "generation_eos_ids", "load_language_model"]
