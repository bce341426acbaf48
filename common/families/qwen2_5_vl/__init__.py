"""Qwen2.5-VL: a window-attention ViT at dynamic resolution (the token count follows the image size), M-RoPE
positions, videos in temporal patches."""

from common.families.family import ModelFamily

FAMILY = ModelFamily(
    name="qwen2_5_vl",
    model_types=("qwen2_5_vl",),
    hf_class="Qwen2_5_VLForConditionalGeneration",
    real_checkpoint="Qwen/Qwen2.5-VL-7B-Instruct",
    dynamic_resolution=True,
    takes_video=True,
    # HF's processor in fp32 and on CPUs, the device-side one on a GPU in half precision.
    local_preprocess="auto",
    vision_encoder="common.families.qwen2_5_vl.encoder:QwenVisionEncoder",
    presets="common.families.qwen2_5_vl.maker:QWEN_PRESETS",
    maker="common.families.qwen2_5_vl.maker:make_qwen_model",
    layout="common.families.qwen2_5_vl.layout:QwenImageLayout",
    oracle="common.families.qwen2_5_vl.oracle:QwenOracle",
    text="common.families.qwen2_5_vl.text:TEXT",
)
