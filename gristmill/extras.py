"""The parts of gristmill that live in an optional extra (`gristmill[ray]`), named here and
imported when first used, as entry points are.

Why names and not imports: gristmill.ray is built on gristmill.batch (its actors run a
processor's batches, its Serve engine answers RowRequests), so imports point ray/ ->
batch/. batch/ still hands a Ray Dataset to Ray Data, reaches a Ray Serve deployment and
offers `gristmill batch --runner ray`: it finds those parts here, by "module:attr", and
never imports gristmill.ray. So there is no import cycle, and batch/ loads where Ray is not
installed (the ImportError that says what to install comes when a Ray part is asked for).
"""

from __future__ import annotations

import importlib

#: What runs a processor over another library's dataset, by the module its type comes from:
#: `runner(processor, dataset)` returns a dataset of that library with the processor's stages.
DATASET_RUNNERS = {"ray.data": "gristmill.ray.data:process_dataset"}
#: `gristmill batch --runner NAME` besides "local" (in this process):
#: `runner(processor, address)` has `stream(rows)`, the processor's rows in input order.
BATCH_RUNNERS = {"ray": "gristmill.ray.data:DatasetRunner"}
#: The RowEngine of `DeploymentProcessorConfig(deployment_name=, app_name=)`, a Ray Serve
#: deployment: `engine_class(deployment_name, app_name)`.
SERVE_ENGINE = "gristmill.ray.handle:ServeEngine"


def load(name: str):
    """What `name` ("module:attr") names; ImportError when its extra is not installed."""
    module, _, attr = name.partition(":")
    return getattr(importlib.import_module(module), attr)


def dataset_runner(rows):
    """The runner of `rows` when they are another library's dataset (a Ray Dataset), else None."""
    module = type(rows).__module__
    for package, name in DATASET_RUNNERS.items():
        if module == package or module.startswith(package + "."):
            return load(name)
    return None
