"""gristmill: LLM batch inference and serving over one engine of our own."""

from gristmill.config import EngineConfig
from gristmill.errors import (EngineDeadError, EngineOverloadedError, GenerationError, GristmillError,
                              InsufficientMemoryError, LoRAAdapterError, PromptTooLongError, RequestError, is_fatal)
from gristmill.lora import LoRARequest
from gristmill.outputs import (ClassificationOutput, ClassificationRequestOutput, CompletionOutput, EmbeddingOutput,
                               EmbeddingRequestOutput, Logprob, PoolingOutput, PoolingRequestOutput, RequestOutput,
                               ScoringOutput, ScoringRequestOutput)
from gristmill.pooling_params import PoolingParams
from gristmill.sampling import SamplingParams

__all__ = ["LLM", "AsyncEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob",
           "PoolingParams", "PoolingRequestOutput", "PoolingOutput", "EmbeddingRequestOutput", "EmbeddingOutput",
           "ClassificationRequestOutput", "ClassificationOutput", "ScoringRequestOutput", "ScoringOutput",
           "GristmillError", "RequestError", "PromptTooLongError", "GenerationError",
           "EngineOverloadedError", "EngineDeadError", "InsufficientMemoryError", "is_fatal", "LoRARequest",
           "LoRAAdapterError"]


def __getattr__(name):
    # LLM pulls in torch and the model code; load it only when asked for.
    if name == "LLM":
        from gristmill.llm import LLM
        return LLM
    if name == "AsyncEngine":
        from gristmill.engine.async_engine import AsyncEngine
        return AsyncEngine
    raise AttributeError(f"module 'gristmill' has no attribute {name!r}")
