"""The error taxonomy: what failed, whether it is fatal, and how it maps to HTTP.

Every error says what happened and what to change. Errors keep their type and fields
through pickling (processes, Ray), so a caller on the far side of a process boundary
can classify them with `is_fatal`.
"""

from __future__ import annotations

import re


class GristmillError(Exception):
    """Base of every error gristmill raises on purpose."""

    #: HTTP status the server answers with.
    http_status: int = 500
    #: OpenAI error envelope `type`.
    error_type: str = "internal_error"
    #: True when the engine can no longer be trusted (see `is_fatal`).
    fatal: bool = False

    def __init__(self, message: str, **fields):
        if not message:
            raise ValueError(f"{type(self).__name__} needs a message that says what to change")
        super().__init__(message)
        self.message = message
        self.fields = fields
        for key, value in fields.items():
            setattr(self, key, value)

    def __reduce__(self):
        return (_rebuild, (type(self), self.message, self.fields))

    def __str__(self) -> str:
        return self.message


def _rebuild(cls, message, fields):
    return cls(message, **fields)


class RequestError(GristmillError, ValueError):
    """The request is invalid or can never be served; `param` names the field to change."""

    http_status = 400
    error_type = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None, **fields):
        super().__init__(message, param=param, **fields)


class PromptTooLongError(RequestError):
    """Prompt plus max_tokens exceed max_model_len, or the KV cache cannot ever hold it."""


class LoRAAdapterError(RequestError):
    """A LoRA adapter a request names cannot run: its files are missing or corrupt, or its
    rank, modules or shapes do not fit the model or the engine (`max_lora_rank`). Only the
    requests naming it fail; `lora_name` names it."""

    def __init__(self, message: str, param: str | None = "lora_request", lora_name: str | None = None, **fields):
        super().__init__(message, param=param, lora_name=lora_name, **fields)


class GenerationError(GristmillError, ValueError):
    """This one request failed inside the engine; other requests are unaffected.

    A ValueError, as RequestError is, so that callers which sort errors by builtin type
    (Ray Data LLM's Serve stage keeps a row going only on ValueError, TypeError,
    TimeoutError) treat it as the one row's failure, never as the job's.
    """

    http_status = 500
    error_type = "internal_error"


class EngineOverloadedError(GristmillError):
    """The waiting queue is full; retry later."""

    http_status = 503
    error_type = "overloaded_error"


class EngineDeadError(GristmillError):
    """The engine core died, hung, or its state can no longer be trusted."""

    http_status = 503
    error_type = "engine_dead_error"
    fatal = True


class InsufficientMemoryError(GristmillError, MemoryError):
    """The model cannot fit in the memory available (refused before it loads), or its
    engine core was killed for running out of memory. The message gives the figures:
    weights, KV cache, memory available, and what to change."""

    http_status = 503
    error_type = "insufficient_memory_error"


# Exception class names from other libraries that mean the engine is gone: a Ray actor
# or Serve replica died, a deployment is unavailable or keeps refusing work.
_FATAL_FOREIGN_NAMES = frozenset({"RayActorError", "ActorDiedError", "ActorUnavailableError",
                                  "DeploymentUnavailableError", "BackPressureError", "EngineDeadError",
                                  "OutOfMemoryError", "WorkerCrashedError", "NodeDiedError"})
# Ray wrappers that carry a remote error only as text (a Ray Data map's exception reaches
# the driver as RayTaskError(UserCodeException) unless raise_original_map_exception is set).
_TEXT_WRAPPERS = ("RayTaskError", "UserCodeException")
_FATAL_IN_TEXT = re.compile(r"(?:^|[\s.(])(" + "|".join(sorted(_FATAL_FOREIGN_NAMES)) + r")(?::|\(| )", re.M)


def is_fatal(exc: BaseException) -> bool:
    """True when `exc` (or anything it wraps) means the engine can no longer be trusted.

    Unwraps `__cause__` chains, wrappers that keep the original in `.cause` (Ray's
    `RayTaskError`), and Ray wrappers that keep it only as text.
    """
    for current in _chain(exc):
        if isinstance(current, GristmillError):
            if current.fatal:
                return True
            continue  # a typed gristmill error says for itself; its text may quote others
        if any(cls.__name__ in _FATAL_FOREIGN_NAMES for cls in type(current).__mro__):
            return True
        if type(current).__name__.startswith(_TEXT_WRAPPERS) and _FATAL_IN_TEXT.search(str(current)):
            return True
    return False


def root_cause(exc: BaseException) -> BaseException:
    """The gristmill error inside `exc`'s wrappers (Ray's RayTaskError, `__cause__`
    chains, or a Ray wrapper's traceback text), or `exc` itself when there is none."""
    chain = list(_chain(exc))
    for current in chain:
        if isinstance(current, GristmillError) and not type(current).__name__.startswith(_TEXT_WRAPPERS):
            return current
    for current in chain:
        if type(current).__name__.startswith(_TEXT_WRAPPERS):
            found = _from_text(str(current))
            if found is not None:
                return found
    return exc


_RAISED_IN_TEXT = re.compile(r"^gristmill\.errors\.(\w+): (.+)$", re.M)


def _from_text(text: str) -> GristmillError | None:
    """The last gristmill error a remote traceback shows, rebuilt (type and message)."""
    for name, message in reversed(_RAISED_IN_TEXT.findall(text)):
        cls = globals().get(name)
        if isinstance(cls, type) and issubclass(cls, GristmillError):
            return cls(message)
    return None


def _chain(exc: BaseException):
    """`exc` and every error it wraps, outermost first."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        current = todo.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        for link in (getattr(current, "cause", None), current.__cause__):
            if isinstance(link, BaseException):
                todo.append(link)


def error_from_string(text: str) -> GristmillError:
    """The error of a request the engine core ended, from its `error_string`: a
    RequestError of its own type (a LoRAAdapterError) when it names one, else a
    GenerationError with its message."""
    name, _, message = text.partition(": ")
    cls = globals().get(name)
    if message and isinstance(cls, type) and issubclass(cls, RequestError):
        return cls(message)
    return GenerationError(text.split(": ", 1)[-1])


def last_line(exc: BaseException, limit: int = 300) -> str:
    """The last line of `exc`'s text: for a remote traceback (Ray's), what was raised."""
    text = str(exc).strip()
    return text.splitlines()[-1][:limit] if text else type(exc).__name__


def error_string(exc: BaseException) -> str:
    """The `"<ErrorType>: <message>"` form used in outputs and batch rows."""
    return f"{type(exc).__name__}: {exc}"
