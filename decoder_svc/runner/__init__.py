"""The model runner: owns execution on the device (buffers, attention metadata, CUDA graphs, sampling)."""

from decoder_svc.runner.inputs import ModelInput, ModelOutput, SequenceInput
from decoder_svc.runner.model_runner import ModelRunner
from decoder_svc.runner.runner_config import RunnerConfig
from decoder_svc.runner.sampler import Sampler, SamplerOutput, SamplingRow, TokenLogprobs

__all__ = ["ModelInput", "ModelOutput", "ModelRunner", "RunnerConfig", "Sampler", "SamplerOutput",
           "SamplingRow", "SequenceInput", "TokenLogprobs"]
