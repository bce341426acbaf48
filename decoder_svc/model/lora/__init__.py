"""Batched LoRA adapters in the decoder: PEFT-format adapters read at start-up (adapter.py) and a
checkpoint's own adapters (builtin.py: Phi-4-multimodal's vision LoRA), stacked into
per-module slot tensors and applied per token row inside one batch (batched.py), with a torch reference
product (reference.py) and a Triton kernel (common/kernels/lora.py); a built-in adapter also merged into a
copy of its projections for steps whose rows all run it (merged.py)."""

from decoder_svc.model.lora.adapter import LoRAAdapter, LoRAError, load_adapter
from decoder_svc.model.lora.batched import LoRALinear, LoRASlots, attach_adapters

__all__ = ["LoRAAdapter", "LoRAError", "LoRALinear", "LoRASlots", "attach_adapters", "load_adapter"]
