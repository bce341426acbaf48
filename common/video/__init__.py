"""Video input, as Hugging Face's video processors take it, under a family's video rules (one concept a
file; the rules, which frames, what size, what timing, are the family's: its layout's `video_config`):

- limits.py: VideoLimits (caps checked from the header) and VideoError (INVALID_ARGUMENT);
- probe.py: the container header read with PyAV, nothing decoded (VideoInfo, probe_video);
- decode.py: the sampled frames decoded, only up to the last one needed (decode_video);
- rules.py: what a family's rules give this code (VideoConfig: sampling, geometry, normalisation,
  timing; VideoTiming);
- patches.py: frames to patch rows in HF's layout (video_patches);
- hashing.py: the content hash over the container bytes and every parameter, no decoding
  (hash_video_bytes);
- request.py: a request's fps / max_frames / pixel range applied within the server's caps
  (video_request_config);
- pipeline.py: bytes to frames, grid, tokens, timestamps and hash in one call (read_video), or all
  but the frames from the header alone (plan_video).

PyAV (wheels bundle FFmpeg) decodes; torchvision is not needed.
"""

from common.video.decode import DecodedVideo, decode_video
from common.video.hashing import hash_video_bytes
from common.video.limits import VideoError, VideoLimits
from common.video.patches import video_patches
from common.video.pipeline import SampledVideo, VideoPlan, plan_video, read_video
from common.video.probe import VideoInfo, probe_video
from common.video.request import video_input_config, video_request_config
from common.video.rules import VideoConfig, VideoTiming

__all__ = ["DecodedVideo", "SampledVideo", "VideoConfig", "VideoError", "VideoInfo", "VideoLimits",
           "VideoPlan", "VideoTiming", "decode_video", "hash_video_bytes", "plan_video", "probe_video",
           "read_video", "video_input_config", "video_patches", "video_request_config"]
