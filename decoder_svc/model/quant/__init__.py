"""FP8 weights for the decoder: the scale layout (fp8), checkpoint formats (formats), the layer (linear),
quantizing or loading at start-up (load). The GPU kernels are common/kernels/fp8_linear.py (which routes)
and fp8_split_k.py (2-64 rows)."""
