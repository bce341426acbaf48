"""Video input for the Qwen VL family, as Hugging Face's video processors take it (one concept a file):

- limits.py: VideoLimits (caps checked from the header) and VideoError (INVALID_ARGUMENT);
- probe.py: the container header read with PyAV, nothing decoded (VideoInfo, probe_video);
- decode.py: the sampled frames decoded, only up to the last one needed (decode_video);
- sampling.py: HF's frame sampling for Qwen2/2.5-VL and Qwen3-VL (FrameSampling);
- timestamps.py: Qwen3-VL's per-group timestamps, Qwen2.5-VL's seconds per group (VideoTiming);
- geometry.py: resize, (t, h, w) grid and token counts (VideoGeometry);
- config.py: a checkpoint's video settings, HF's defaults and files (QwenVideoConfig);
- patches.py: frames to patch rows in HF's layout (video_patches);
- hashing.py: the content hash over the container bytes and every parameter, no decoding
  (hash_video_bytes);
- request.py: a request's fps / max_frames / pixel range applied within the server's caps
  (video_request_config);
- pipeline.py: bytes to frames, grid, tokens, timestamps and hash in one call (read_video), or all
  but the frames from the header alone (plan_video).

PyAV (wheels bundle FFmpeg) decodes; torchvision is not needed.
"""

from common.video.config import QWEN2_VL_VIDEO, QWEN3_VL_VIDEO, QwenVideoConfig, load_qwen_video_config
from common.video.decode import DecodedVideo, decode_video
from common.video.geometry import VideoGeometry
from common.video.hashing import hash_video_bytes
from common.video.limits import VideoError, VideoLimits
from common.video.patches import video_patches
from common.video.pipeline import SampledVideo, VideoPlan, plan_video, read_video
from common.video.probe import VideoInfo, probe_video
from common.video.request import video_input_config, video_request_config
from common.video.sampling import FrameSampling
from common.video.timestamps import VideoTiming, video_timing

__all__ = ["QWEN2_VL_VIDEO", "QWEN3_VL_VIDEO", "DecodedVideo", "FrameSampling", "QwenVideoConfig",
           "SampledVideo", "VideoError", "VideoGeometry", "VideoInfo", "VideoLimits", "VideoPlan",
           "VideoTiming", "decode_video", "hash_video_bytes", "load_qwen_video_config", "plan_video",
           "probe_video", "read_video", "video_input_config", "video_patches", "video_request_config",
           "video_timing"]
