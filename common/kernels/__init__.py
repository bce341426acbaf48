"""The GPU kernels (Triton and Gluon) and their thin launch wrappers: the decoder's attention, KV store,
elementwise ops, one-row products (fused GEMV, TMA-streamed GEMV), FP8 products (split-K), LoRA,
argmax and embedding rows, programmatic dependent launch, the batch-invariant product, the fused MoE, and the
vision towers' fused ops.

This package is the bottom layer: it imports torch, triton and the standard library only, never the
rest of the project (tests/common/test_layering.py checks it), so the encoder and the decoder both build
on it. Which kernel a model layer takes (shape dispatch, measured choices) is decided above it, in
decoder_svc/model/kernel_dispatch.py. Modules import triton at the top: import them on GPU paths or
under TRITON_INTERPRET=1 (tests) only, but for vision_fused_ops, which imports without Triton.
"""
