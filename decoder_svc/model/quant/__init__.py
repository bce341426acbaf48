"""FP8 weights for the decoder: the scale layout (fp8), checkpoint formats (formats), the layer (linear),
quantizing or loading at start-up (load), and the GPU kernels (triton_fp8, which routes; triton_split_k at
2-64 rows)."""
