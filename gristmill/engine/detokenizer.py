"""Incremental detokenization and stop strings, one `IncrementalDetokenizer` per completion."""

from __future__ import annotations

# Tokens re-decoded before the new ones, so word boundaries and spaces come out right.
_CONTEXT_TOKENS = 5
# Most byte tokens one character takes (UTF-8).
_UTF8_MAX = 4


def _stream(tokenizer, skip_special_tokens: bool, context: list[int]):
    """A Rust `DecodeStream` fed `context`, when the tokenizer is a fast one that cleans
    up no spaces (then it gives the text the two decodes below give, for one call a
    token instead of two decodes); else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    try:
        from tokenizers.decoders import DecodeStream
    except ImportError:
        return None
    stream = DecodeStream(skip_special_tokens=skip_special_tokens)
    if context:
        try:
            stream.step(backend, context)
        except Exception:  # a prompt that ends inside a character it cannot follow: no stream
            return None
    return lambda token_id: stream.step(backend, token_id)


def _decoder(tokenizer, skip_special_tokens: bool):
    """ids -> text as `tokenizer.decode` gives it. With a fast tokenizer that cleans up no
    spaces, its Rust backend directly: the same text without the Python wrapper around
    it, which costs more than the decode itself (two decodes a token, every token)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, a few tokens at a time.

    Decodes `ids[prefix:]` and drops the text of `ids[prefix:read]`, so each call costs a
    handful of tokens, not the whole sequence. Text that ends in an incomplete UTF-8
    character waits for the next token. Stop strings cut the text before them.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str],
                 skip_special_tokens: bool = True, incremental: bool = True, min_tokens: int = 0,
                 include_stop: bool = False):
        """`incremental=False`: nobody reads the text before the end (offline generate), so
        without stop strings the tokens are held and decoded once, when `text` is read.
        `min_tokens`: stop strings count only from that many tokens on. `include_stop`: the
        text ends with the stop string that ended it (vLLM's include_stop_str_in_output)."""
        self.tokenizer = tokenizer
        self.stop = stop
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self._text = ""
        self.held: list[int] | None = None if incremental or stop else []
        self.emitted = 0
        self.stopped = False
        #: The stop string that ended the text, once one did.
        self.stop_string: str | None = None
        self.num_tokens = 0
        self.min_tokens = min_tokens
        self.include_stop = include_stop
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self._decode = _decoder(tokenizer, skip_special_tokens)
        self._step = _stream(tokenizer, skip_special_tokens, self.ids)
        # The stream's tokens whose text it has not given yet; on a stream error the
        # two-decode path takes over from `self.ids`, the tokens whose text is out.
        self._pending: list[int] = []

    @property
    def text(self) -> str:
        if self.held:
            held, self.held = self.held, []
            self._add(held)
            if self._pending:
                # The stream gives no text while its text ends inside a character, and
                # these tokens end inside one: they go one by one, as they would have come.
                self._two_decode(self._leave_stream())
        return self._text

    def add_tokens(self, token_ids: list[int]) -> bool:
        """Append tokens; returns True when a stop string ended the text."""
        if self.held is not None:
            self.held.extend(token_ids)
            return False
        return self._add(token_ids)

    def _add(self, token_ids: list[int]) -> bool:
        if self._step is not None:
            fed = 0
            try:
                if not self.stop:  # nothing to look for between tokens: one call for them all
                    # ... but the last few one by one: a call gives no text at all while
                    # its text ends inside a character (a UTF-8 character is at most 4
                    # byte tokens), and the characters before it must still come out.
                    body, tail = token_ids[:-_UTF8_MAX], token_ids[-_UTF8_MAX:]
                    for chunk in ([list(body)] if body else []) + [[t] for t in tail]:
                        fed += len(chunk)
                        self.num_tokens += len(chunk)
                        self._stream_text(chunk, self._text_out)
                    return False
                for token_id in token_ids:
                    if self.stopped:
                        break
                    fed += 1
                    self.num_tokens += 1
                    self._stream_text([token_id], self._append)
                return self.stopped
            except Exception:
                # The Rust stream refuses some byte-fallback sequences ("Invalid prefix
                # encountered while decoding stream") that decoding whole ids handles:
                # the two-decode path goes on from the last text the stream gave.
                token_ids = self._leave_stream() + list(token_ids[fed:])
        return self._two_decode(token_ids)

    def _leave_stream(self) -> list[int]:
        """Off the stream, onto the two-decode path from the last text the stream gave:
        the tokens the stream took and gave no text for yet, to decode again."""
        self._step = None
        self.num_tokens -= len(self._pending)
        pending, self._pending = self._pending, []
        self.prefix_offset, self.read_offset = 0, len(self.ids)
        return pending

    def _two_decode(self, token_ids: list[int]) -> bool:
        for token_id in token_ids:
            if self.stopped:
                break
            self.num_tokens += 1
            self.ids.append(token_id)
            prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
            full_text = self._decode(self.ids[self.prefix_offset:])
            if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
                new_text = full_text[len(prefix_text):]
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.ids)
                self._append(new_text)
        return self.stopped

    def _stream_text(self, token_ids: list[int], take) -> None:
        self._pending.extend(token_ids)
        new_text = self._step(token_ids if len(token_ids) > 1 else token_ids[0])
        if new_text:
            # The pending tokens' text is out: keep the last few as context.
            self.ids = (self.ids + self._pending)[-_CONTEXT_TOKENS:]
            self._pending = []
            take(new_text)

    def _text_out(self, new_text: str) -> None:
        self._text += new_text

    def _append(self, new_text: str) -> None:
        start = max(0, len(self._text) - self._holdback)
        self._text += new_text
        if self.num_tokens < self.min_tokens:
            return
        hits = [(at, -len(stop), stop) for stop in self.stop if (at := self._text.find(stop, start)) != -1]
        if hits:
            at, _, self.stop_string = min(hits)
            self._text = self._text[:at + len(self.stop_string) if self.include_stop else at]
            self.stopped = True

    def take_delta(self, finished: bool) -> str:
        """Text not handed out yet; while running, keeps back what may begin a stop string."""
        end = len(self.text) if finished or self.stopped else max(self.emitted, len(self.text) - self._holdback)
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta
