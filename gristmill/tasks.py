"""Which task an engine runs (`EngineConfig.task`), from what was asked and the model.

One task per engine: "generate" (text), or a pooling task: "embed", "classify",
"score". "auto" reads it off the model directory (config.json's architectures, and
sentence-transformers' modules.json); a task the model cannot do is refused here, before
anything loads, saying which it can. Imports no torch (clients resolve it too).
"""

from __future__ import annotations

import json
from pathlib import Path

from gristmill.errors import RequestError
from gristmill.pooling_params import POOLING_TASKS


def model_kind(model_dir: Path) -> tuple[str, int | None]:
    """("causal" | "encoder" | "backbone" | "embedder" | "classifier", number of labels of a
    classifier)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return "causal", None  # (the loader says what is wrong with it)
    architectures = config.get("architectures") or []
    if any(a.endswith("ForSequenceClassification") for a in architectures):
        labels = config.get("id2label")
        return "classifier", len(labels) if isinstance(labels, dict) and labels else config.get("num_labels", 2)
    if config.get("model_type") == "bert":
        return "encoder", None
    bidirectional = config.get("use_bidirectional_attention") or (config.get("text_config") or {}).get(
        "use_bidirectional_attention")
    if bidirectional or (architectures and all(a.endswith("Model") for a in architectures)):
        return "backbone", None  # (no LM head: an embedding model such as Qwen3-Embedding)
    if (Path(model_dir) / "modules.json").exists():
        return "embedder", None  # (a sentence-transformers model over a decoder with its LM head)
    return "causal", None


def resolve_task(task: str, model_dir: Path) -> str:
    """The task an engine runs: `task` itself when the model can do it, the model's own
    for "auto"; RequestError (param "task") when the model cannot."""
    kind, num_labels = model_kind(model_dir)
    name = Path(model_dir).name
    if task == "auto":
        if kind == "classifier":
            return "score" if num_labels == 1 else "classify"
        return "embed" if kind in ("encoder", "backbone", "embedder") else "generate"
    able = {"causal": ("generate", "embed", "score"), "encoder": ("embed", "score"),
            "backbone": ("embed", "score"), "embedder": ("embed", "score", "generate"),
            "classifier": ("classify", "score") if num_labels == 1 else ("classify",)}[kind]
    if task not in able:
        what = {"causal": "a text generation model", "encoder": "an encoder (no LM head)",
                "backbone": "an embedding model (a decoder without its LM head)", "embedder": "an embedding model",
                "classifier": f"a sequence classifier ({num_labels} labels)"}[kind]
        raise RequestError(f"task={task!r}: {name} is {what}; it can run task "
                           + " or ".join(repr(t) for t in able) + " (or 'auto')", param="task")
    return task


def is_pooling(task: str) -> bool:
    return task in POOLING_TASKS
