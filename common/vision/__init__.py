"""The vision pieces several families' encoders share. Both services use them: the encoder service runs an
encoder for clients, the decoder's in-process embedding source (tests, benchmarks) runs it locally, and
neither imports the other's service code.

- `encoders.py`: a checkpoint's VisionEncoder (common/families/encoder.py) as its family declares it;
- `pixels.py`: the checkpoint's image processor reproduced with torch ops on the device;
- `graphs.py`: CUDA graphs of a tower for batch-size buckets; `tower_graphs.py`: per batch signature;
- `attention.py`, `prepared.py`: a grid tower's attention and its prepared inputs;
- `fp8.py`: an FP8 tower's linear layers (`--vision-quantization fp8`).

This module imports nothing heavy: the encoder's command line reads PREPROCESS_MODES from it.
"""

# auto: torch on CUDA in half precision (when the processor can be reproduced), else hf
# (common/families/encoder.py)
PREPROCESS_MODES = ("auto", "hf", "torch")
# the encoder's --vision-quantization (common/vision/fp8.py)
VISION_QUANTIZATION = ("none", "fp8")
