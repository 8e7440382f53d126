"""`POST /tokenize` and `POST /detokenize`, in vLLM's shapes: the token ids the engine reads
for a prompt (or a chat, rendered with the model's template), and the text of token ids."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, field_validator

from gristmill.engine.async_engine import AsyncEngine
from gristmill.errors import RequestError
from gristmill.server.protocol import ChatMessage, _no_booleans
from gristmill.tokenizer import render_chat

TOKENIZE_PATH, DETOKENIZE_PATH = "/tokenize", "/detokenize"


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")  # (a field it does not know would change the count)

    model: str | None = None
    #: A text, or (a chat) `messages` with the chat template's fields.
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    #: None: true for a prompt, false for a chat (its template writes them), as vLLM.
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    tools: list[dict] | None = None
    #: Each token's text too (`token_strs`).
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]

    _ids = field_validator("tokens", mode="before")(_no_booleans)


async def tokenize(engine: AsyncEngine, body: TokenizeRequest) -> dict:
    """{"count", "max_model_len", "tokens", "token_strs"} of the body's prompt or chat."""
    if (body.prompt is None) == (body.messages is None):
        raise RequestError("send either prompt (a text) or messages (a chat), not both or neither", param="prompt")
    if body.prompt is not None:
        text, special = body.prompt, True if body.add_special_tokens is None else body.add_special_tokens
    else:
        text = render_chat(engine.tokenizer, [m.model_dump() for m in body.messages], body.add_generation_prompt,
                           body.continue_final_message, body.chat_template_kwargs, tools=body.tools)
        special = bool(body.add_special_tokens)
    ids = await engine.tokenize(text, special)
    strs = engine.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(engine: AsyncEngine, body: DetokenizeRequest) -> dict:
    """{"prompt": the text of the body's token ids}; an id outside the vocabulary is a 400."""
    vocab = len(engine.tokenizer)
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise RequestError(f"token id {bad} is not in the vocabulary (0 to {vocab - 1})", param="tokens")
    return {"prompt": engine.tokenizer.decode(body.tokens)}

