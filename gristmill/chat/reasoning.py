"""Reasoning parsers: split a reasoning model's output into its reasoning (the text inside
`<think>` ... `</think>`) and its content (the answer after it), whole or as a stream.

One parser per model family, registered by name in `REASONING_PARSERS`; `get_reasoning_parser`
takes a name, `reasoning_parser_for` reads a model's chat template. The families differ in
who opens the reasoning when the prompt has not:

- "qwen3": Qwen3's hybrid models write `<think>` themselves when they think; an output that
  does not start with it is all content.
- "deepseek_r1": DeepSeek-R1 (and models that always reason, like QwQ) start in the
  reasoning whether or not they write `<think>`; an output that never writes `</think>`
  is all reasoning.

The prompt decides first, for both: a prompt that ends with `<think>` (the chat template
opened the reasoning) starts the output inside it; one that ends with `</think>` (the
template closed it: Qwen3's `enable_thinking=False` writes an empty `<think>\\n\\n</think>`)
makes the whole output content, verbatim. Callers pass the prompt text whenever they have
it; without it the family's default above applies.

The contract, for `split` and `stream` alike:
- reasoning is None when the output had no reasoning, else its text without surrounding
  whitespace ("" for an empty `<think></think>`); an optional `<think>` at the start of a
  reasoning that the prompt opened is dropped;
- content after `</think>` loses its leading whitespace; content with no reasoning before
  it is kept verbatim; a `<think>` or `</think>` inside content is content;
- streaming: any split of the output into deltas gives the same joined fields as `split`
  (which runs the stream on the whole text); text that may be the start of a marker, and
  whitespace that may touch one, wait in the stream until more text or `finish` decides.
"""

from __future__ import annotations

from dataclasses import dataclass

from gristmill.chat.markers import may_become, undecided_tail

START = "<think>"
END = "</think>"
REASONING = "reasoning"
CONTENT = "content"


@dataclass(frozen=True, slots=True)
class Delta:
    """A piece of streamed output: `field` is "reasoning" or "content"; `text` is never empty."""

    field: str
    text: str


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    """One family's reasoning format. `always_reasons`: an output the prompt did not open
    starts in the reasoning (DeepSeek-R1) instead of in content unless it writes `<think>`
    (Qwen3)."""

    name: str
    always_reasons: bool
    start_marker: str = START
    #: The text that ends the reasoning; a constraint on the answer applies after it.
    end_marker: str = END

    def initial_field(self, prompt_text: str | None = None) -> str | None:
        """Where the output starts: "reasoning", "content", or None when its first
        characters decide (whether it writes `<think>`)."""
        if prompt_text is not None:
            tail = prompt_text.rstrip()
            if tail.endswith(self.start_marker):
                return REASONING
            if tail.endswith(self.end_marker):
                return CONTENT
        return REASONING if self.always_reasons else None

    def stream(self, prompt_text: str | None = None) -> ReasoningStream:
        """A stream over one output of a request whose prompt was `prompt_text`."""
        return ReasoningStream(self, prompt_text)

    def split(self, text: str, prompt_text: str | None = None) -> tuple[str | None, str]:
        """A whole output -> (reasoning or None, content)."""
        stream = self.stream(prompt_text)
        deltas = stream.feed(text) + stream.finish()
        reasoning = "".join(d.text for d in deltas if d.field == REASONING)
        content = "".join(d.text for d in deltas if d.field == CONTENT)
        return (reasoning if stream.reasoning_started else None), content

    def reasoning_ended(self, text: str, prompt_text: str | None = None) -> bool:
        """Whether the output so far (`text`) is past its reasoning, or had none: what
        follows is the answer, on which a constraint (JSON schema, tool call) applies.
        False while the first characters may still open a reasoning."""
        stream = self.stream(prompt_text)
        stream.feed(text)
        return stream.reasoning_ended


# A stream's states: before the output's first characters decide whether `<think>` opens a
# reasoning; inside a reasoning the prompt opened, where a repeated `<think>` may come first;
# inside the reasoning; in content.
_OPENING, _REASONING_OPENED, _REASONING, _CONTENT = "opening", "reasoning_opened", "reasoning", "content"


class ReasoningStream:
    """The incremental split of one output: `feed(delta_text)` and then `finish()` return
    the new `Delta`s, consecutive pieces of one field merged."""

    def __init__(self, parser: ReasoningParser, prompt_text: str | None = None):
        self._parser = parser
        self._pending = ""  # received, not yet decided
        initial = parser.initial_field(prompt_text)
        self._state = {None: _OPENING, REASONING: _REASONING_OPENED, CONTENT: _CONTENT}[initial]
        self._trim = False  # drop the current field's leading whitespace
        self.reasoning_started = initial == REASONING

    @property
    def reasoning_ended(self) -> bool:
        """True once the rest of the output is content (or it had no reasoning)."""
        return self._state == _CONTENT

    def feed(self, delta_text: str) -> list[Delta]:
        self._pending += delta_text
        return self._advance(final=False)

    def finish(self) -> list[Delta]:
        """Decide what is still held back: the output ended."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> list[Delta]:
        out: list[Delta] = []
        start, end = self._parser.start_marker, self._parser.end_marker
        if self._state in (_OPENING, _REASONING_OPENED):
            head = self._pending.lstrip()
            if head.startswith(start):
                self._pending = head[len(start):]
            elif not final and may_become(head, start):
                return out
            if self._state == _OPENING and not head.startswith(start):
                self._state = _CONTENT  # verbatim: no reasoning came before it
            else:
                self._state, self._trim, self.reasoning_started = _REASONING, True, True
        if self._state == _REASONING:
            if self._trim:
                self._pending = self._pending.lstrip()
                self._trim = not self._pending
            cut = self._pending.find(end)
            if cut >= 0:
                _emit(out, REASONING, self._pending[:cut].rstrip())
                self._pending = self._pending[cut + len(end):]
                self._state, self._trim = _CONTENT, True
            else:
                decided = self._pending if final else self._pending[:len(self._pending) - undecided_tail(
                    self._pending, (end,))]
                decided = decided.rstrip()  # trailing whitespace may touch `</think>`
                _emit(out, REASONING, decided)
                self._pending = self._pending[len(decided):]
                if final:
                    self._pending = ""
                return out
        if self._trim:
            self._pending = self._pending.lstrip()
            self._trim = not self._pending
        _emit(out, CONTENT, self._pending)
        self._pending = ""
        return out


def _emit(out: list[Delta], field: str, text: str) -> None:
    if not text:
        return
    if out and out[-1].field == field:
        out[-1] = Delta(field, out[-1].text + text)
    else:
        out.append(Delta(field, text))


REASONING_PARSERS: dict[str, ReasoningParser] = {
    "qwen3": ReasoningParser("qwen3", always_reasons=False),
    "deepseek_r1": ReasoningParser("deepseek_r1", always_reasons=True),
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser registered as `name`; an unknown name is a ValueError listing the known ones."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; the known ones are "
                         f"{', '.join(sorted(REASONING_PARSERS))}") from None


#: `EngineConfig.reasoning_parser`'s value that turns the split off, whatever the chat template.
NO_PARSER = "none"


def check_reasoning_parser_name(name: str | None) -> None:
    """ValueError unless `name` is None (from the chat template), "none" or a known parser."""
    if name is not None and name != NO_PARSER:
        get_reasoning_parser(name)


def choose_reasoning_parser(setting: str | None, chat_template: str | None) -> ReasoningParser | None:
    """The parser an engine splits its chats with: `setting` (EngineConfig.reasoning_parser)
    by name; None: the one the model's chat template calls for (`reasoning_parser_for`), if
    any; "none": no split."""
    if setting == NO_PARSER:
        return None
    name = setting if setting is not None else reasoning_parser_for(chat_template)
    return None if name is None else get_reasoning_parser(name)


def reasoning_parser_for(chat_template: str | None) -> str | None:
    """The name of the reasoning parser a chat template calls for, or None when the model
    does not reason. A template that mentions `<think>` or `</think>` and switches thinking
    with `enable_thinking` is Qwen3's hybrid one; any other that mentions them (DeepSeek-R1
    and its distills, QwQ, Qwen3's thinking-only models) is a model that always reasons."""
    if not chat_template or (START not in chat_template and END not in chat_template):
        return None
    return "qwen3" if "enable_thinking" in chat_template else "deepseek_r1"
