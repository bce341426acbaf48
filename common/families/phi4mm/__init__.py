"""Phi-4-multimodal (`Phi4MultimodalForCausalLM`, microsoft/Phi-4-multimodal-instruct): an image becomes a
global view and up to `dynamic_hd` 448 px crops chosen from its aspect ratio, each through SigLIP, 2x2
token compression, row separators (sub_GN) and a global separator (glb_GN), then a two-layer projector;
the token count follows the image's size through its crops.

Served by both services: the HD transform without torchvision (pixels.py, bit-exact with HF's
processor's ops; bench/phi4mm_pixels_check.py checks it against HF's processor where torchvision is
installed), the layout (token counts from the header, the `<|image|>` expansion), the tower and image
embedding (tower.py, embedder.py: equal to HF's Phi4MultimodalImageEmbedding in fp32), the encoder, the
oracle and the `phi-4-mm-tiny` / `phi-4-mm` presets, and the text model in decoder_svc/model (Phi-4-mini's
layers: partial rotary and LongRoPE as TextModelConfig fields, served up to
original_max_position_embeddings, decoder_svc/model/longrope.py).

The checkpoint's vision LoRA (its `lora_A.vision` / `lora_B.vision` tensors and config.json's
`vision_lora`) is served as the built-in adapter "vision" (checkpoint_adapters; decoder_svc/model/lora/
builtin.py) in the decoder's batched LoRA slots: the layout's request_adapter picks it for a request with
images, text alone runs the base model, and prefix-cache blocks are keyed by it. The oracle merges it into
HF's weights for image requests (HF's class holds no LoRA modules). Audio is refused by name (the layout's
unserved_markers, the tokenizer's chat parts, the gateway's input_audio parts); the speech LoRA is not read.
"""

from common.families.family import ModelFamily

FAMILY = ModelFamily(
    name="phi4mm",
    model_types=("phi4_multimodal",),
    hf_class="Phi4MultimodalForCausalLM",
    real_checkpoint="microsoft/Phi-4-multimodal-instruct",
    dynamic_resolution=True,
    takes_video=False,
    # pixels.py's HD transform in every mode (HF's processor needs torchvision)
    local_preprocess="auto",
    vision_encoder="common.families.phi4mm.encoder:Phi4VisionEncoder",
    presets="common.families.phi4mm.maker:PHI4_PRESETS",
    maker="common.families.phi4mm.maker:make_phi4_model",
    layout="common.families.phi4mm.layout:Phi4ImageLayout",
    oracle="common.families.phi4mm.oracle:Phi4Oracle",
    text="common.families.phi4mm.text:TEXT",
    processor_stand_in="common.families.phi4mm.oracle:Phi4ProcessorReproduction",
    # Its vision LoRA, stored in the checkpoint's own weights (decoder_svc/model/lora/builtin.py).
    checkpoint_adapters=("vision",),
    # The Hub repository's main branch is the remote-code form (configuration_phi4mm.py, its own tensor
    # names); transformers' converter writes the form served here, with vision-lora/ as a PEFT folder.
    convert_from=(("phi4mm", "this is Phi-4-multimodal's remote-code form: convert it to transformers' "
                   "Phi4Multimodal form first with transformers' convert_phi4_multimodal_weights_to_hf.py "
                   "(src/transformers/models/phi4_multimodal/ in its repository), and keep the vision "
                   "adapter it extracts as a PEFT folder named vision-lora/ beside the weights"),),
)
