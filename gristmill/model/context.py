"""What one forward pass runs with, reachable from every layer: the step's metadata
(where its tokens go in the paged KV cache) and the backend whose arithmetic runs.

The model runner sets both around each forward, so model `forward` signatures stay
`(input_ids, positions)`. Outside a forward (unit tests calling a module directly),
layers run the torch reference backend and attention has no metadata.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gristmill.model.metadata import StepMetadata
    from gristmill.model.backends.reference import Backend

_metadata: "StepMetadata | None" = None
_backend: "Backend | None" = None
_reference: "Backend | None" = None


@contextmanager
def forward_context(metadata: "StepMetadata | None", backend: "Backend"):
    global _metadata, _backend
    saved = _metadata, _backend
    _metadata, _backend = metadata, backend
    try:
        yield
    finally:
        _metadata, _backend = saved


def get_metadata() -> "StepMetadata":
    if _metadata is None:
        raise RuntimeError("attention metadata is not set: run the model through ModelRunner")
    return _metadata


def has_metadata() -> bool:
    return _metadata is not None


def current_backend() -> "Backend":
    global _reference
    if _backend is not None:
        return _backend
    if _reference is None:
        from gristmill.model.backends.reference import Backend
        _reference = Backend()
    return _reference
