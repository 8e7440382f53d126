"""The pooling tasks in one table: for each of "embed", "classify" and "score", the pooler
head it reads, what it gives, its output field, its batch column, its server route and
the PoolingParams fields it takes; one check (and one message) for a call the engine's
model does not answer; one cosine. Every face (LLM, AsyncEngine, the server, batch) asks
here. No torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gristmill.errors import RequestError


@dataclass(frozen=True, slots=True)
class PoolingTask:
    """`head`: the pooler head whose output it returns ("embed", "classify"; None for
    "score": a cross-encoder's, or the cosine of two embeddings); `gives`: what it returns,
    as messages say it; `output`: its field of a request output's `outputs`; `column`: its
    batch output column; `route`: its server endpoint; `fields`: the PoolingParams fields
    it takes."""

    name: str
    head: str | None
    gives: str
    output: str
    column: str
    route: str
    fields: tuple[str, ...]


POOLING_TASKS: dict[str, PoolingTask] = {t.name: t for t in (
    PoolingTask("embed", "embed", "embeddings", "embedding", "embeddings", "/v1/embeddings",
                ("dimensions", "normalize", "truncate_prompt_tokens")),
    PoolingTask("classify", "classify", "a classifier's labels", "probs", "probs", "/v1/classify",
                ("use_activation", "truncate_prompt_tokens")),
    PoolingTask("score", None, "relevance scores", "score", "score", "/v1/score",
                ("use_activation", "truncate_prompt_tokens")),
)}
#: Where each task's requests go on the server (score's also to the rerank routes).
TASK_ROUTES = {"embed": "/v1/embeddings, /v1/score, /v1/rerank", "classify": "/v1/classify",
               "score": "/v1/score, /v1/rerank"}


def model_gives(pooler) -> str:
    """What a pooling engine's model gives (`Capacity.pooler`), as messages say it."""
    if pooler is None or pooler.head == "embed":
        return "embeddings"
    return f"a classifier's {pooler.dimensions} labels"


def check_task(asked: str, capacity, pair: bool = False, what: str | None = None) -> None:
    """RequestError (param "task") unless this engine answers a call of pooling task
    `asked` ("encode": whatever the model gives): it runs a pooling task, and its model
    gives what `asked` returns. Scoring is a cross-encoder's reading of a text `pair` in one
    request, or (an embedding model, not `pair`) the cosine of two embeddings. `what`: the
    call or route named in the message (default: `asked`)."""
    what = what or asked
    if capacity.task == "generate":
        raise RequestError(f"{what} needs a pooling engine; this one generates text (task 'generate'). Start one "
                           f"with task='embed', 'classify' or 'score' (gristmill serve --task ...) and a model that "
                           f"can, e.g. LLM(model, task='embed')", param="task")
    pooler = capacity.pooler
    head = pooler.head if pooler is not None else "embed"
    if asked == "score":
        if (head == "embed" and pair) or (head == "classify" and pooler.dimensions != 1):
            raise RequestError(f"{what}: scoring text pairs in one request needs a cross-encoder (a classifier "
                               f"with one label); this engine's model gives {model_gives(pooler)}"
                               + (": score by the cosine of two embeddings" if head == "embed" else ""), param="task")
        return
    task = POOLING_TASKS.get(asked)
    if task is not None and task.head != head:
        raise RequestError(f"{what} needs a model that gives {task.gives}; this engine runs task "
                           f"{capacity.task!r}, whose model gives {model_gives(pooler)}", param="task")


def check_generates(capacity, what: str) -> None:
    """RequestError (param "task") unless this engine generates text."""
    if capacity.task != "generate":
        raise RequestError(f"{what} needs an engine that generates text; this one runs task {capacity.task!r}, it "
                           f"does not generate text: send {TASK_ROUTES[capacity.task]} requests (LLM."
                           f"{capacity.task}), or start an engine with task='generate'", param="task")


def cosine(a, b) -> float:
    """The cosine of two unit-length embeddings (their dot product)."""
    return float(math.fsum(x * y for x, y in zip(a, b)))
