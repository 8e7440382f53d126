"""The error taxonomy: pickling, classification, messages."""

from __future__ import annotations

import pickle

import pytest

from gristmill.errors import (EngineDeadError, EngineOverloadedError, GenerationError, GristmillError,
                              PromptTooLongError, RequestError, error_string, is_fatal)


@pytest.mark.parametrize("error", [
    RequestError("temperature must be >= 0", param="temperature"),
    PromptTooLongError("prompt (90 tokens) + max_tokens (50) exceeds max_model_len (128)",
                       param="max_tokens", num_prompt_tokens=90, max_model_len=128),
    GenerationError("detokenizing failed: boom"),
    EngineOverloadedError("the engine is overloaded; retry later"),
    EngineDeadError("the engine core process (pid 1) was killed by signal SIGKILL"),
])
def test_errors_survive_pickling_with_type_message_and_fields(error):
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert str(copy) == str(error) and copy.message == error.message
    assert copy.fields == error.fields
    for key, value in error.fields.items():
        assert getattr(copy, key) == value
    assert is_fatal(copy) == is_fatal(error)


def test_taxonomy_classes_and_http_mapping_data():
    assert issubclass(RequestError, ValueError) and issubclass(PromptTooLongError, RequestError)
    assert RequestError.http_status == 400 and RequestError.error_type == "invalid_request_error"
    assert GenerationError.http_status == 500
    assert EngineOverloadedError.http_status == EngineDeadError.http_status == 503
    assert all(issubclass(c, GristmillError) for c in (GenerationError, EngineOverloadedError, EngineDeadError))


def test_every_error_needs_a_message():
    with pytest.raises(ValueError):
        GenerationError("")


class RayTaskError(Exception):
    """Shaped like Ray's wrapper: the original error is in `.cause`."""

    def __init__(self, cause):
        super().__init__(f"task failed: {cause}")
        self.cause = cause


class RayActorError(Exception):
    pass


def test_is_fatal_classifies_plain_wrapped_and_chained_errors():
    dead = EngineDeadError("the engine core died")
    assert is_fatal(dead)
    assert not is_fatal(RequestError("bad", param="x"))
    assert not is_fatal(GenerationError("one request failed"))
    assert not is_fatal(EngineOverloadedError("busy"))
    assert not is_fatal(ValueError("plain"))
    assert is_fatal(RayTaskError(dead))
    assert not is_fatal(RayTaskError(PromptTooLongError("too long", param="prompt")))
    assert is_fatal(RayActorError("the actor died"))
    try:
        try:
            raise dead
        except EngineDeadError as inner:
            raise RuntimeError("the batch failed") from inner
    except RuntimeError as outer:
        assert is_fatal(outer)
        assert is_fatal(RayTaskError(outer))


def test_error_string_form():
    assert error_string(GenerationError("boom")) == "GenerationError: boom"
