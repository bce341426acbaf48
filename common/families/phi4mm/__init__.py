"""Phi-4-multimodal (`Phi4MultimodalForCausalLM`, microsoft/Phi-4-multimodal-instruct): an image becomes a
global view and up to `dynamic_hd` 448 px crops chosen from its aspect ratio, each through SigLIP, 2x2
token compression, row separators (sub_GN) and a global separator (glb_GN), then a two-layer projector;
the token count follows the image's size through its crops.

Declared, not served by the decoder (listed in the registry's NOT_SERVED_YET); the encoder service serves
its images already (encoder_served_early: registry.vision_family_of finds it). Built: the HD transform without
torchvision (pixels.py, bit-exact with HF's processor's ops; bench/phi4mm_pixels_check.py checks it
against HF's processor where torchvision is installed), the layout (token counts from the header, the
`<|image|>` expansion), the tower and image embedding (tower.py, embedder.py: equal to HF's
Phi4MultimodalImageEmbedding in fp32), the encoder, the oracle and the `phi-4-mm-tiny` / `phi-4-mm`
presets, and the text model in decoder_svc/model (Phi-4-mini's layers: partial rotary and LongRoPE as
TextModelConfig fields, served up to original_max_position_embeddings, decoder_svc/model/longrope.py), equal
to HF's greedy text generation with no adapter (tests/phi4mm/test_text_generate.py, which loads it through
EngineConfig.unserved_text_only). The encoder service serves its images (tests/phi4mm/
test_encoder_service.py); image requests through the encoder service and the engine equal HF's base
model, which has no adapter (tests/phi4mm/test_image_generate.py, through the same test-only switch).
Not yet: the per-request LoRA adapters (the vision LoRA chosen when a request has images, KV blocks keyed
by adapter), then the decoder serving the family. Audio is refused by name (the layout's
unserved_markers, the tokenizer's chat parts, the gateway's input_audio parts).
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
    # The encoder service serves its images (equal to HF's image embedding; tests/phi4mm/
    # test_encoder_service.py); the decoder refuses the checkpoint until the vision LoRA is served.
    encoder_served_early=True,
)
