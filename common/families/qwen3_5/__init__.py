"""Qwen3.5: a native vision-language model whose language model mixes Gated DeltaNet (linear attention)
layers with gated full-attention layers (every 4th), behind Qwen3-VL's vision tower without DeepStack.
Images and videos are laid out as Qwen3-VL's (16-px patches merged 2x2, interleaved M-RoPE, timestamped
video frames); each image's embedding is one [tokens, hidden] tensor.

Served: the decoder's layers read the hybrid stack from the TextSpec (text.py), the Gated DeltaNet layers'
state lives in per-request slots beside the paged KV cache (decoder_svc/model/linear_state.py,
decoder_svc/engine/state_slots.py), and a prefix is reused from snapshots of that state taken at image ends,
every few blocks and at the prompt's last block boundary (decoder_svc/engine/state_snapshots.py). The MoE
sibling is common/families/qwen3_5_moe/.
"""

from common.families.family import ModelFamily

FAMILY = ModelFamily(
    name="qwen3_5",
    model_types=("qwen3_5",),
    hf_class="Qwen3_5ForConditionalGeneration",
    real_checkpoint="Qwen/Qwen3.5-9B",
    dynamic_resolution=True,
    takes_video=True,
    local_preprocess="auto",
    vision_encoder="common.families.qwen3_5.encoder:Qwen3_5VisionEncoder",
    presets="common.families.qwen3_5.maker:QWEN3_5_PRESETS",
    maker="common.families.qwen3_5.maker:make_qwen3_5_model",
    layout="common.families.qwen3_5.layout:Qwen3_5ImageLayout",
    oracle="common.families.qwen3_5.oracle:Qwen3_5Oracle",
    text="common.families.qwen3_5.text:TEXT",
)
