"""Incremental detokenization and stop strings, one `IncrementalDetokenizer` per completion."""

from __future__ import annotations

# Tokens re-decoded before the new ones, so word boundaries and spaces come out right.
_CONTEXT_TOKENS = 5


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
        stream.step(backend, context)
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
                 skip_special_tokens: bool = True, incremental: bool = True, min_tokens: int = 0):
        """`incremental=False`: nobody reads the text before the end (offline generate), so
        without stop strings the tokens are held and decoded once, when `text` is read.
        `min_tokens`: stop strings count only from that many tokens on."""
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
        self.num_tokens = 0
        self.min_tokens = min_tokens
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self._decode = _decoder(tokenizer, skip_special_tokens)
        self._step = _stream(tokenizer, skip_special_tokens, self.ids)

    @property
    def text(self) -> str:
        if self.held:
            held, self.held = self.held, []
            self._add(held)
        return self._text

    def add_tokens(self, token_ids: list[int]) -> bool:
        """Append tokens; returns True when a stop string ended the text."""
        if self.held is not None:
            self.held.extend(token_ids)
            return False
        return self._add(token_ids)

    def _add(self, token_ids: list[int]) -> bool:
        if self._step is not None:
            if not self.stop:  # nothing to look for between tokens: one call for them all
                new_text = self._step(list(token_ids))
                if new_text:
                    self._text += new_text
                return False
            for token_id in token_ids:
                if self.stopped:
                    break
                self.num_tokens += 1
                new_text = self._step(token_id)
                if new_text:
                    self._append(new_text)
            return self.stopped
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

    def _append(self, new_text: str) -> None:
        start = max(0, len(self._text) - self._holdback)
        self._text += new_text
        if self.num_tokens < self.min_tokens:
            return
        hits = [at for stop in self.stop if (at := self._text.find(stop, start)) != -1]
        if hits:
            self._text = self._text[:min(hits)]
            self.stopped = True

    def take_delta(self, finished: bool) -> str:
        """Text not handed out yet; while running, keeps back what may begin a stop string."""
        end = len(self.text) if finished or self.stopped else max(self.emitted, len(self.text) - self._holdback)
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta
