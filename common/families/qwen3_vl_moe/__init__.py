"""Qwen3-VL-MoE (Qwen3-VL-30B-A3B): Qwen3-VL whose language model is a mixture of experts, Qwen3-MoE (each
layer's MLP is `num_experts` SwiGLU experts, `num_experts_per_tok` of them per token; the router's top-k
probabilities renormalised). The vision tower, DeepStack levels, image layout, interleaved M-RoPE and
timestamped video path are Qwen3-VL's, shared by import; only the checkpoint checks, the maker's presets,
the oracle's HF class and the text backbone are this folder's. The experts' layer is
decoder_svc/model/moe.py (the fused GPU kernels: common/kernels/fused_moe.py)."""

from common.families.family import ModelFamily

FAMILY = ModelFamily(
    name="qwen3_vl_moe",
    model_types=("qwen3_vl_moe",),
    hf_class="Qwen3VLMoeForConditionalGeneration",
    real_checkpoint="Qwen/Qwen3-VL-30B-A3B-Instruct",
    dynamic_resolution=True,
    takes_video=True,
    local_preprocess="auto",
    vision_encoder="common.families.qwen3_vl_moe.encoder:Qwen3MoeVisionEncoder",
    presets="common.families.qwen3_vl_moe.maker:QWEN3_MOE_PRESETS",
    maker="common.families.qwen3_vl_moe.maker:make_qwen3_moe_model",
    layout="common.families.qwen3_vl_moe.layout:Qwen3MoeImageLayout",
    oracle="common.families.qwen3_vl_moe.oracle:Qwen3MoeOracle",
    text="common.families.qwen3_vl_moe.text:TEXT",
)
