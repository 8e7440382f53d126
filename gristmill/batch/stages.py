"""RowEngine, the one interface a processor runs rows on, and the stages before it (chat
template, tokenize).

The processor opens the engine its config names (`Processor.open_engine`):
- EngineProcessorConfig: an EnginePool of its own (engines.py);
- DeploymentProcessorConfig: the pool of a `deploy(...)` deployment, borrowed (deployment.py),
  or with `app_name` a Ray Serve deployment (ServeEngine, in the Ray extra);
- HttpProcessorConfig: an OpenAI-compatible server (HttpEngine, http.py).

Where a row's chat template and tokenizer run is the engine's to say, once, in `stages`:
`LocalStages` run them in this process with the engine's own tokenizer (an EnginePool: stop
strings and faults then see the text the engine got); `REMOTE_STAGES` leave rows as they
are for an engine that applies its own (a server, a Serve deployment). The processor calls
the stages of every row's engine and never asks which they are.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

from gristmill.batch.config import ProcessorConfig
from gristmill.batch.row_tools import with_tools
from gristmill.batch.rows import Generated, Pooled, RowRequest
from gristmill.errors import RequestError


class RowStages(Protocol):
    def chat(self, request: RowRequest, config: ProcessorConfig) -> RowRequest:
        """`request`, whose `messages` are what it sends, as the engine takes it
        (`prompt_token_ids` are those the row brings too, if any)."""

    def tokenize(self, request: RowRequest, config: ProcessorConfig) -> RowRequest:
        """`request` with its `prompt_token_ids`, where they are made before the engine."""


class RowEngine(Protocol):
    #: The chat-template and tokenize stages of a row bound for this engine.
    stages: RowStages

    async def generate(self, request: RowRequest) -> Generated:
        """One row's result; a row's own failure raises its error, a dead engine a fatal one."""

    async def pool(self, request: RowRequest) -> Pooled:
        """One pooling row's result (its `task`: embed, classify, score), failing as `generate` does."""

    async def close(self) -> None:
        """Release what the processor opened (a shared deployment stays up for its other users)."""


def _refuse_template_off(config: ProcessorConfig) -> None:
    if not config.apply_chat_template:
        raise RequestError("the row has 'messages' but apply_chat_template is off; send 'prompt' "
                           "or turn it on", param="messages")


class LocalStages:
    """The chat template and the tokenizer run here, before the engine, with its tokenizer.
    `engine` has `render_chat(messages, template_kwargs, tools) -> str`, `tokenize(prompt,
    add_special_tokens)` and `tool_parser` (what reads a chat's calls; None: no format)."""

    def __init__(self, engine):
        self.engine = engine

    def chat(self, request: RowRequest, config: ProcessorConfig) -> RowRequest:
        _refuse_template_off(config)
        request = with_tools(request, self.engine.tool_parser)
        tools = request.tools.tools if request.tools is not None else None
        # A rendered chat holds its own special tokens.
        rendered = replace(request, prompt=self.engine.render_chat(request.messages, request.chat_template_kwargs,
                                                                   tools),
                           messages=None, add_special_tokens=False, chat=True)
        return self.tokenize(rendered, config)

    def tokenize(self, request: RowRequest, config: ProcessorConfig) -> RowRequest:
        if request.tool_fields is not None:  # a chat a stage before this one rendered (Ray Data's)
            request = with_tools(request, self.engine.tool_parser)
        # Generating, the engine tokenizes the text itself (and its faults see the text).
        if request.prompt_token_ids is None and request.prompt is not None and config.tokenize \
                and not config.generate:
            token_ids = self.engine.tokenize(request.prompt, request.add_special_tokens)
            return replace(request, prompt_token_ids=token_ids)
        return request


class _RemoteStages:
    """The engine applies its own chat template and tokenizer: a row's chat is sent as its
    `messages`, its prompt as text. What it cannot honour is refused per row, as an engine
    of the processor's own refuses it, never ignored: `apply_chat_template=False` for a
    row's messages (it would apply its template all the same), and `generate=False` (it
    tokenizes inside, so it has no token ids to give the processor)."""

    def chat(self, request: RowRequest, config: ProcessorConfig) -> RowRequest:
        _refuse_template_off(config)
        _refuse_tokenize_only(config)
        return replace(request, prompt_token_ids=None)  # the engine tokenizes the chat it renders

    def tokenize(self, request: RowRequest, config: ProcessorConfig) -> RowRequest:
        _refuse_tokenize_only(config)
        return request


def _refuse_tokenize_only(config: ProcessorConfig) -> None:
    if not config.generate:
        raise RequestError("generate=False needs a tokenizer beside the processor, and this engine (a server, "
                           "a Serve deployment) tokenizes inside: run the tokenize stage with "
                           "EngineProcessorConfig(engine=..., generate=False), or leave generate on",
                           param="generate")


REMOTE_STAGES = _RemoteStages()
