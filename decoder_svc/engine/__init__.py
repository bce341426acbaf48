"""The in-process decoder engine: requests, scheduler, block manager, sampler and the step loop."""

from decoder_svc.engine.embedding_source import EmbeddingRequest, EmbeddingSource, EmbeddingState
from decoder_svc.engine.engine import EngineConfig, EngineStats, LLMEngine, QueueFullError
from decoder_svc.engine.output_processor import RequestOutput, Usage
from decoder_svc.engine.request import FinishReason
from decoder_svc.engine.sampling_params import InvalidRequestError, SamplingParams
from decoder_svc.runner.sampler import TokenLogprobs

__all__ = ["EmbeddingRequest", "EmbeddingSource", "EmbeddingState", "EngineConfig", "EngineStats",
           "FinishReason", "InvalidRequestError", "LLMEngine", "QueueFullError", "RequestOutput",
           "SamplingParams", "TokenLogprobs", "Usage"]
