"""Qwen3.5-MoE (Qwen3.5-35B-A3B): Qwen3.5 whose every MLP is a mixture of experts with a shared expert. The
hybrid stack (Gated DeltaNet layers with state slots and snapshots beside gated full attention), the vision
tower, image layout, M-RoPE and video path are Qwen3.5's, shared by import; the experts' layer is Qwen3-
VL-MoE's (decoder_svc/model/moe.py, the fused GPU kernels in common/kernels/fused_moe.py) with the shared
expert and its sigmoid gate added. Only the checkpoint checks, the maker's presets, the oracle's HF class
and the text backbone are this folder's."""

from common.families.family import ModelFamily

FAMILY = ModelFamily(
    name="qwen3_5_moe",
    model_types=("qwen3_5_moe",),
    hf_class="Qwen3_5MoeForConditionalGeneration",
    real_checkpoint="Qwen/Qwen3.5-35B-A3B",
    dynamic_resolution=True,
    takes_video=True,
    local_preprocess="auto",
    vision_encoder="common.families.qwen3_5_moe.encoder:Qwen3_5MoeVisionEncoder",
    presets="common.families.qwen3_5_moe.maker:QWEN3_5_MOE_PRESETS",
    maker="common.families.qwen3_5_moe.maker:make_qwen3_5_moe_model",
    layout="common.families.qwen3_5_moe.layout:Qwen3_5MoeImageLayout",
    oracle="common.families.qwen3_5_moe.oracle:Qwen3_5MoeOracle",
    text="common.families.qwen3_5_moe.text:TEXT",
)
