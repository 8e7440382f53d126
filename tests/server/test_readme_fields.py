"""The README's list of the request fields of /v1/completions and /v1/chat/completions is
checked against what the server takes: every field of the body models and of the sampling
field table is named there, and every field it names as refused is refused. No server."""

from __future__ import annotations

import re
from pathlib import Path

from gristmill.openai_fields import SAMPLING_FIELDS
from gristmill.server.protocol import UNSUPPORTED, ChatCompletionRequest, CompletionRequest

README = Path(__file__).resolve().parents[2] / "README.md"
#: Body fields that are the request itself, not options a list of fields names.
SELF_EVIDENT = {"model", "prompt", "messages", "stream"}


def endpoint_bullet() -> str:
    """The README bullet that lists the completions and chat fields, and the echo bullet."""
    text = README.read_text()
    start = text.index("- `POST /v1/completions`, `POST /v1/chat/completions`")
    end = text.index("- **It heals itself.**", start)
    return text[start:end]


def test_every_field_the_server_takes_is_in_the_readme():
    named = set(re.findall(r"`([a-z_]+)`", endpoint_bullet()))
    taken = (set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)) - SELF_EVIDENT
    assert taken - named == set(), f"fields the server takes that the README does not list: {taken - named}"
    table = {f.name for f in SAMPLING_FIELDS}
    assert table <= taken, f"sampling fields the body models do not take: {table - taken}"


def test_every_field_the_readme_says_is_refused_is_refused():
    bullet = endpoint_bullet()
    refused_part = bullet[bullet.index("that would change the"):bullet.index("is a 400 naming it")]
    refused = set(re.findall(r"`([a-z_]+)`", refused_part)) - {"tools", "function_call", "echo"}
    assert refused and refused <= set(UNSUPPORTED), refused - set(UNSUPPORTED)


def test_the_readme_does_not_say_echo_with_logprobs_is_refused():
    """The server answers echo with logprobs (tests/server/test_prompt_scoring.py)."""
    echo = endpoint_bullet()[endpoint_bullet().index("- `echo: true`"):]
    assert "not supported" not in echo and "400" not in echo
