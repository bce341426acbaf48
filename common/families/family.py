"""What one model family declares: the typed interface the services, the engine and the tools ask instead
of testing `model_type` themselves (vLLM's model registry is the idea: names resolve to code lazily, so
asking about a family imports neither torch nor transformers).

A family's folder (`common/families/<name>/`) holds its `FAMILY` (`__init__.py`) and its own code: its
image layout (`layout.py`, an ImageLayout of common/families/layout.py), its preset maker (`maker.py`),
and its vision encoder (`encoder.py`, a VisionEncoder of common/families/encoder.py) over its tower.
The registry (`common/families/registry.py`) lists the folders. FAMILY names that code by
"module:attribute", loaded on first use.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from common.families.encoder import VisionEncoder
    from common.families.layout import ImageLayout
    from common.families.text import TextSpec


def load_attr(ref: str) -> Any:
    """The object a "package.module:attribute" reference names (imported on first use)."""
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class ModelFamily:
    """One family of vision-language checkpoints and where its code lives.

    Capabilities are data, so that callers branch on what a family does, never on which one it is.
    """

    name: str                     # the folder's name: "llava", "qwen2_5_vl", "qwen3_vl"
    model_types: tuple[str, ...]  # config.json `model_type` values it serves
    hf_class: str                 # the transformers class the tests' oracle runs (generate, image features)
    real_checkpoint: str          # a Hub id of a real checkpoint (what its presets copy; the launcher's hint)
    dynamic_resolution: bool      # every image's token count follows its size (a grid read from its header)
    takes_video: bool             # video inputs (`<|video_pad|>` runs) are served
    local_preprocess: str         # the in-process encoder's preprocessing ("hf" or "auto")
    vision_encoder: str           # "module:Class": its VisionEncoder (model_dir, device, dtype, preprocess=)
    presets: str                  # "module:DICT" of its `make-model` presets, by name
    maker: str                    # "module:function" writing a random checkpoint of one of those presets
    layout: str                   # "module:Class" of its ImageLayout (common/families/layout.py)
    oracle: str                   # "module:Class" running hf_class on a checkpoint (the tests' reference)
    text: str                     # "module:TEXT": its TextSpec (text backbones, weight prefixes; text.py)
    # LoRA adapters the checkpoint carries in itself, by name (decoder_svc/model/lora/builtin.py reads
    # them: Phi-4-multimodal's "vision"); served in slots after the --lora-modules ones, chosen per request
    # by the layout's request_adapter.
    checkpoint_adapters: tuple[str, ...] = ()
    # Other formats of its checkpoints that it does not read, by config.json model_type: how to convert
    # them (the refusal says so; e.g. the remote-code form of Phi-4-multimodal on the Hub).
    convert_from: tuple[tuple[str, str], ...] = ()
    # "module:Class" built from a checkpoint directory and called as its HF image processor is
    # (images=[...], return_tensors="pt"): the family's own reproduction of that processor, for hosts
    # where HF's cannot load (Phi-4-multimodal's needs torchvision). Benchmarks' HF references use it there.
    processor_stand_in: str | None = None

    def layout_class(self) -> type[ImageLayout]:
        """Its ImageLayout class (loads the text processor and reads a checkpoint's layout)."""
        return load_attr(self.layout)

    def text_spec(self) -> TextSpec:
        """Its language model's declaration (common/families/text.py)."""
        return load_attr(self.text)

    def image_layout(self, model_dir: str | Path, config: dict[str, Any]) -> ImageLayout:
        """The image layout of its checkpoint in model_dir (config: its config.json); CheckpointError with
        the reason when the checkpoint cannot be served."""
        return self.layout_class().from_checkpoint(model_dir, config)

    def make_oracle(self, model_dir: str | Path) -> Any:
        """Its HF oracle over the checkpoint in model_dir (imports transformers; tests only)."""
        return load_attr(self.oracle)(model_dir)

    def image_processor_stand_in(self, model_dir: str | Path) -> Any:
        """Its reproduction of the checkpoint's HF image processor (processor_stand_in); ValueError when it
        declares none."""
        if self.processor_stand_in is None:
            raise ValueError(f"the {self.name} family has no stand-in for its HF image processor")
        return load_attr(self.processor_stand_in)(model_dir)

    def make_vision_encoder(self, model_dir: str | Path, device: Any = "cpu", dtype: Any = None,
                            preprocess: str = "auto") -> VisionEncoder:
        """The family's vision encoder over the checkpoint in model_dir (torch dtype; None: float32)."""
        import torch

        cls = load_attr(self.vision_encoder)
        return cls(model_dir, device, torch.float32 if dtype is None else dtype, preprocess=preprocess)

    def preset_names(self) -> list[str]:
        """Its `make-model` presets, in declaration order."""
        return list(load_attr(self.presets))

    def make_model(self, preset: str, out: str | Path, seed: int = 0, device: str | None = None,
                   dtype: str | None = None, gain: float = 1.4, progress: bool = True,
                   vision_only: bool = False) -> Path:
        """Write a random checkpoint of one of its presets into out (common/model_maker.make_model's
        contract)."""
        return load_attr(self.maker)(preset, out, seed, device, dtype, gain, progress, vision_only)
