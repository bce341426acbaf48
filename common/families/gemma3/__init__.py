"""Gemma 3 (`Gemma3ForConditionalGeneration`, e.g. google/gemma-3-4b-it): a SigLIP tower whose patch grid
is average-pooled to a fixed `mm_tokens_per_image` tokens, Gemma's (1 + w) RMSNorm and a projection;
`<start_of_image>` expanded by the processor into a block around the soft tokens.

NOT SERVED YET: this FAMILY is declared but not in common/families/registry.FAMILIES, so gemma3
checkpoints are still refused (UnsupportedModelError). What exists is the image path, exact against HF
in fp32 (layout, tower, encoder, oracle, the `gemma-3-tiny` maker), and the text model on the torch path
(decoder_svc/model: TextModelConfig parses gemma3_text into fields the shared layers read; text-only
greedy generation through the engine equals HF's, tests/gemma3/test_text_*.py). What is missing: the
attention has no bidirectional block mask over each image's tokens, which HF's token_type_ids mask
applies during prefill; the prompt tokenizer assumes the marker is the placeholder token, which Gemma's
block expansion breaks; Gemma's norms and GELU exist in TorchOps only (the model refuses TritonOps, so
Gemma 3 runs on attention backend "torch" only, although TritonAttentionBackend masks windows and key
limits), and the sliding layers keep every KV block (none freed past the window).
"""

from common.families.family import ModelFamily

FAMILY = ModelFamily(
    name="gemma3",
    model_types=("gemma3",),
    hf_class="Gemma3ForConditionalGeneration",
    real_checkpoint="google/gemma-3-4b-it",
    dynamic_resolution=False,
    takes_video=False,
    # The HF image processor, always, for now: fp32 parity with HF is the contract its tests check.
    local_preprocess="hf",
    vision_encoder="common.families.gemma3.encoder:Gemma3VisionEncoder",
    presets="common.families.gemma3.maker:GEMMA3_PRESETS",
    maker="common.families.gemma3.maker:make_gemma3_model",
    layout="common.families.gemma3.layout:Gemma3ImageLayout",
    oracle="common.families.gemma3.oracle:Gemma3Oracle",
)
