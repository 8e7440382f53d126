"""Batch pipelines: processors that run rows through an engine.

    from gristmill import EngineConfig
    from gristmill.batch import build_processor, EngineProcessorConfig

    processor = build_processor(EngineProcessorConfig(engine=EngineConfig(), batch_size=64),
                                preprocess=lambda row: {**row, "prompt": row["question"]})
    rows = processor([{"question": "The capital of France is"}])
"""

import importlib

# Each name is imported from its module when first used (PEP 562): importing a module of
# the package (the command line's `batch` flags, its row readers) runs this file, and
# should not import every processor, deployment and engine module with it.
_EXPORTS = {
    "build_processor": "processor", "Processor": "processor", "UserFunctionError": "processor",
    "ProcessorConfig": "config", "EngineProcessorConfig": "config", "DeploymentProcessorConfig": "config",
    "HttpProcessorConfig": "config", "deploy": "deployment", "Deployment": "deployment",
    "OUTPUT_COLUMNS": "rows", "ERROR_COLUMN": "rows",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
