"""LLaVA-1.5 and its architecture relatives (BakLLaVA, LLaVA-Interleave): a CLIP or SigLIP tower and a
projector, a fixed number of tokens per image, a Llama, Mistral or Qwen2 language model."""

from common.families.family import ModelFamily

FAMILY = ModelFamily(
    name="llava",
    model_types=("llava",),
    hf_class="LlavaForConditionalGeneration",
    real_checkpoint="llava-hf/llava-1.5-7b-hf",
    dynamic_resolution=False,
    takes_video=False,
    # The HF image processor, always: the engine's HF-parity tests (CPU and GPU) run against it.
    local_preprocess="hf",
    vision_encoder="common.families.llava.encoder:LlavaVisionEncoder",
    presets="common.families.llava.maker:PRESETS",
    maker="common.families.llava.maker:make_llava_model",
    layout="common.families.llava.layout:ImageTokenLayout",
    oracle="common.families.llava.oracle:LlavaOracle",
    text="common.families.llava.text:TEXT",
)
