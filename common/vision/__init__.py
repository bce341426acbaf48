"""The vision tower both services use: the encoder service runs it for clients, the decoder's in-process
embedding source (tests, benchmarks) runs it locally, and neither imports the other's service code.

- `tower.py`: VisionEncoder (weights, preprocessing, the tower's forward, its content fingerprint);
- `pixels.py`: the checkpoint's image processor reproduced with torch ops on the device;
- `graphs.py`: CUDA graphs of the tower for batch-size buckets.

This module imports nothing heavy: the encoder's command line reads PREPROCESS_MODES from it.
"""

# auto: torch on CUDA in half precision (when the processor can be reproduced), else hf (tower.py).
PREPROCESS_MODES = ("auto", "hf", "torch")
