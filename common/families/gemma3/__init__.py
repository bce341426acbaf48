"""Gemma 3 (`Gemma3ForConditionalGeneration`, e.g. google/gemma-3-4b-it): a SigLIP tower whose patch grid
is average-pooled to a fixed `mm_tokens_per_image` tokens, Gemma's (1 + w) RMSNorm and a projection;
`<start_of_image>` expanded by the processor into a block around the soft tokens.

Served: the image path is exact against HF in fp32 (layout, tower, encoder, oracle, the `gemma-3-tiny`
maker); the text model (decoder_svc/model: TextModelConfig parses gemma3_text into fields the shared
layers read) runs its sliding-window and global layers; each image's soft tokens attend to each other
whole during prefill (HF's token_type_ids mask: ImageLayout.bidirectional_images, the runner's key
limits, the scheduler keeping each image in one fresh chunk); `<start_of_image>` becomes its block in
the tokenizer (marker_text). Greedy generation equals HF's with and without images
(tests/gemma3/test_*_generate.py). On CUDA its attention, (1 + w) norms and GeGLU run
as Triton kernels. Pan-and-scan crops (the image processor config's
do_pan_and_scan, for every image): the layout counts each image's crops from its header size as HF's
pan_and_scan does and writes Gemma3Processor's crop sentence; the encoder's embedding is the original's
rows then each crop's; the engine fills the image's 1 + crops blocks from that one embedding, each block
bidirectional (tests/gemma3/test_pan_and_scan.py, greedy-exact against HF). The sliding layers keep only
their window's KV blocks (decoder_svc/model/kv_groups.py, engine/kv_cache_manager.py;
tests/gemma3/test_sliding_window_kv.py). Not yet: a per-request pan-and-scan switch, GPU figures of the
real shapes (presets gemma-3-4b, gemma-3-12b).
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
    text="common.families.gemma3.text:TEXT",
)
