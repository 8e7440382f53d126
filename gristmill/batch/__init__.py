"""Batch pipelines: processors that run rows through an engine.

    from gristmill import EngineConfig
    from gristmill.batch import build_processor, EngineProcessorConfig

    processor = build_processor(EngineProcessorConfig(engine=EngineConfig(), batch_size=64),
                                preprocess=lambda row: {**row, "prompt": row["question"]})
    rows = processor([{"question": "The capital of France is"}])
"""

from gristmill.batch.config import (DeploymentProcessorConfig, EngineProcessorConfig, HttpProcessorConfig,
                                    ProcessorConfig)
from gristmill.batch.deployment import Deployment, deploy
from gristmill.batch.processor import Processor, UserFunctionError, build_processor
from gristmill.batch.rows import ERROR_COLUMN, OUTPUT_COLUMNS

__all__ = ["build_processor", "Processor", "ProcessorConfig", "EngineProcessorConfig",
           "DeploymentProcessorConfig", "HttpProcessorConfig", "deploy", "Deployment", "UserFunctionError",
           "OUTPUT_COLUMNS", "ERROR_COLUMN"]
