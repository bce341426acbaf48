"""An in-process embedding source: the checkpoint's CLIP vision tower + projector, run synchronously.

It reproduces `LlavaForConditionalGeneration.get_image_features` (same HF modules, same feature layer
and selection strategy, same projector), so the engine can be tested alone against HF. It keeps a small
LRU of embeddings by content hash so that repeated images count as encoder-cache hits.
"""

from __future__ import annotations

import io
from collections import OrderedDict
from pathlib import Path

import torch
from PIL import Image
from torch import nn

from common.checkpoint import load_tensors
from common.images import decode_image
from decoder_svc.engine.embedding_source import EmbeddingRequest, EmbeddingSource, EmbeddingStatus


class LlavaProjector(nn.Module):
    """linear_1 -> act -> linear_2, as HF's LlavaMultiModalProjector."""

    def __init__(self, in_dim: int, out_dim: int, act: str, bias: bool) -> None:
        from transformers.activations import ACT2FN

        super().__init__()
        self.linear_1 = nn.Linear(in_dim, out_dim, bias=bias)
        self.act = ACT2FN[act]
        self.linear_2 = nn.Linear(out_dim, out_dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class VisionEncoder(nn.Module):
    """Vision tower + projector loaded from a LLaVA checkpoint's vision tensors only."""

    def __init__(self, model_dir: str | Path, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        from transformers import AutoConfig, AutoModel, AutoProcessor

        super().__init__()
        cfg = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
        self.feature_layer = cfg.vision_feature_layer
        self.select_strategy = cfg.vision_feature_select_strategy
        processor = AutoProcessor.from_pretrained(str(model_dir), local_files_only=True)
        self.image_processor = processor.image_processor
        n_layers = 1 if isinstance(self.feature_layer, int) else len(self.feature_layer)
        self.vision_tower = AutoModel.from_config(cfg.vision_config)
        self.multi_modal_projector = LlavaProjector(
            cfg.vision_config.hidden_size * n_layers, cfg.text_config.hidden_size,
            cfg.projector_hidden_act, getattr(cfg, "multimodal_projector_bias", True))
        tensors = load_tensors(model_dir, ["vision_tower.", "multi_modal_projector.",
                                           "model.vision_tower.", "model.multi_modal_projector."])
        self.load_state_dict(self._match_keys(tensors), strict=True)
        self.to(device=device, dtype=dtype).eval()
        self.device, self.dtype = torch.device(device), dtype

    def _match_keys(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # Checkpoints differ in the "model." prefix and in the CLIP "vision_model." level.
        wanted = set(self.state_dict())
        out = {}
        for name, t in tensors.items():
            name = name.removeprefix("model.")
            head, _, rest = name.partition(".")
            for cand in (name, f"{head}.vision_model.{rest}", f"{head}.{rest.removeprefix('vision_model.')}"):
                if cand in wanted:
                    out[cand] = t
                    break
        return out

    @torch.no_grad()
    def forward(self, images: list[Image.Image]) -> list[torch.Tensor]:
        """One [num_image_tokens, hidden] tensor per image."""
        pixels = self.image_processor(images=images, return_tensors="pt")["pixel_values"]
        pixels = pixels.to(self.device, self.dtype)
        out = self.vision_tower(pixels, output_hidden_states=True, return_dict=True)
        layers = [self.feature_layer] if isinstance(self.feature_layer, int) else list(self.feature_layer)
        feats = [out.hidden_states[i] for i in layers]
        if self.select_strategy == "default":
            feats = [f[:, 1:] for f in feats]
        return list(self.multi_modal_projector(torch.cat(feats, dim=-1)))


class LocalEmbeddingSource(EmbeddingSource):
    """Runs the vision encoder inside `request` (synchronous), caching embeddings by content hash."""

    def __init__(self, model_dir: str | Path, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, cache_entries: int = 256) -> None:
        self.encoder = VisionEncoder(model_dir, device, dtype)
        self.cache_entries = cache_entries
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._leases: dict[tuple[str, str], tuple[EmbeddingStatus, bool, str]] = {}
        self.num_encoded = 0
        self.num_cache_hits = 0
        self.num_requests = 0

    def request(self, req: EmbeddingRequest) -> None:
        key = (req.request_id, req.content_hash)
        if key in self._leases:
            return
        self.num_requests += 1
        if req.content_hash in self._cache:
            self._cache.move_to_end(req.content_hash)
            self.num_cache_hits += 1
            self._leases[key] = (EmbeddingStatus.READY, True, "")
            return
        if req.image is None:
            self._leases[key] = (EmbeddingStatus.FAILED, False, f"image {req.content_hash[:16]} not found")
            return
        try:
            image = decode_image(req.image) if isinstance(req.image, bytes) else req.image.convert("RGB")
            emb = self.encoder([image])[0]
        except Exception as exc:  # noqa: BLE001 - any failure fails this image, not the engine
            self._leases[key] = (EmbeddingStatus.FAILED, False, f"{type(exc).__name__}: {exc}")
            return
        self.num_encoded += 1
        self._cache[req.content_hash] = emb
        while len(self._cache) > self.cache_entries:
            self._cache.popitem(last=False)
        self._leases[key] = (EmbeddingStatus.READY, False, "")

    def poll(self, request_id: str, content_hash: str) -> EmbeddingStatus:
        return self._leases.get((request_id, content_hash), (EmbeddingStatus.UNKNOWN,))[0]

    def get(self, request_id: str, content_hash: str) -> torch.Tensor:
        if self.poll(request_id, content_hash) != EmbeddingStatus.READY:
            raise KeyError(f"embedding {content_hash[:16]} for {request_id} is not ready")
        emb = self._cache.get(content_hash)
        if emb is None:  # evicted while leased: recompute is impossible without the image
            raise KeyError(f"embedding {content_hash[:16]} was evicted")
        return emb

    def release(self, request_id: str, content_hash: str | None = None) -> None:
        if content_hash is not None:
            self._leases.pop((request_id, content_hash), None)
            return
        for key in [k for k in self._leases if k[0] == request_id]:
            del self._leases[key]

    def error(self, request_id: str, content_hash: str) -> str:
        return self._leases.get((request_id, content_hash), (None, False, "unknown image"))[2]

    def cache_hit(self, request_id: str, content_hash: str) -> bool:
        return self._leases.get((request_id, content_hash), (None, False))[1]

    @property
    def num_leases(self) -> int:
        """Keys currently held (a leak check for tests)."""
        return len(self._leases)


def encode_png(image: Image.Image) -> bytes:
    """PNG bytes of an image (handy for tests and clients)."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()
