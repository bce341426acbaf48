"""Qwen3-VL: Qwen2.5-VL's layout with a full-attention ViT whose DeepStack levels join the language model's
first layers (a multi-part embedding), interleaved M-RoPE, timestamped videos."""

from common.families.family import ModelFamily

FAMILY = ModelFamily(
    name="qwen3_vl",
    model_types=("qwen3_vl",),
    hf_class="Qwen3VLForConditionalGeneration",
    real_checkpoint="Qwen/Qwen3-VL-8B-Instruct",
    dynamic_resolution=True,
    takes_video=True,
    local_preprocess="auto",
    vision_encoder="common.families.qwen3_vl.encoder:Qwen3VisionEncoder",
    presets="common.families.qwen3_vl.maker:QWEN3_PRESETS",
    maker="common.families.qwen3_vl.maker:make_qwen3_model",
    layout="common.families.qwen2_5_vl.layout:QwenImageLayout",  # Qwen2.5-VL's, reused
    oracle="common.families.qwen3_vl.oracle:Qwen3Oracle",
    text="common.families.qwen3_vl.text:TEXT",
)
