"""OpenAI response bodies and stream chunks, built from engine outputs."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from gristmill.chat.answer import CALL_PIECE, REASONING_PIECE, AnswerReader, merged, read_answer
from gristmill.chat.reasoning import ReasoningParser
from gristmill.chat.tool_choice import ToolRequest
from gristmill.engine.stream import RequestStream
from gristmill.lora import LoRARequest
from gristmill.outputs import Logprob, RequestOutput


@dataclass
class ChatJob:
    """One HTTP request: its engine streams (one per prompt) and how to format it."""
    chat: bool
    request_id: str
    created: int
    n: int
    want_logprobs: bool
    include_usage: bool
    num_top_logprobs: int = 0
    #: With `echo`: each prompt's text, which starts the text of each of its choices.
    echo_texts: list[str] | None = None
    streams: list[RequestStream] = field(default_factory=list)
    prompt_tokens: int = 0
    #: vLLM's return_token_ids: choices carry their token ids.
    return_token_ids: bool = False
    #: The request field its structured-output constraint came from, or None.
    constraint_field: str | None = None
    #: Every streamed chunk carries the usage so far (`_continuous_usage`).
    continuous_usage: bool = False
    #: max_tokens 0 (with echo): the prompt alone is returned, no generated token.
    prompt_only: bool = False
    #: echo with logprobs: each choice's logprobs start with the prompt's tokens'.
    echo_logprobs: bool = False
    #: vLLM's prompt_logprobs field: the prompt's logprobs in its own shape, top-k of them.
    prompt_logprobs: int | None = None
    #: A chat on a reasoning model: what keeps the reasoning apart from the answer, and
    #: the rendered prompt (whether the template opened or closed the reasoning).
    reasoning_parser: ReasoningParser | None = None
    prompt_text: str | None = None
    #: A chat's tool request (with tools; tool_choice "none" reads no calls).
    tools: ToolRequest | None = None
    #: The LoRA adapter its `model` named (None: the base model).
    lora: LoRARequest | None = None


class ChoiceStates:
    """What a stream has sent of each (prompt, completion) choice."""

    def __init__(self, num_prompts: int, n: int):
        self.finished: set[tuple[int, int]] = set()
        #: Each choice's next text_offset: counted over token texts, as the non-streamed
        #: response does, never over the text handed out so far (which lags behind
        #: while it may begin a stop string).
        self.offsets = {(p, i): 0 for p in range(num_prompts) for i in range(n)}
        #: Each chat choice's answer, read as it streams.
        self.readers: dict[tuple[int, int], AnswerReader] = {}

    def delta(self, job: ChatJob, key: tuple[int, int], c) -> dict:
        """A chat chunk's delta for the new text of choice `key`: its `pieces` in one."""
        fields: dict = {}
        for piece in self.pieces(job, key, c):
            for name, value in piece.items():
                fields[name] = fields[name] + value if name in fields else value
        return fields or {"content": ""}

    def pieces(self, job: ChatJob, key: tuple[int, int], c) -> list[dict]:
        """The new text of choice `key` as chat delta fields, in the order the model wrote
        them (`chat.answer`): its reasoning, content and calls (OpenAI's `tool_calls`
        pieces) as they alternate. Text that may begin `</think>` or a call waits until it
        is decided (then: no pieces)."""
        reader = self.readers.get(key)
        if reader is None:
            reader = self.readers[key] = AnswerReader(job.reasoning_parser, job.prompt_text, job.tools)
        pieces = reader.feed(c.delta_text) + (reader.finish() if c.finish_reason is not None else [])
        ordered: list[dict] = []
        for piece in merged(pieces):
            if piece.kind == CALL_PIECE:
                if ordered and "tool_calls" in ordered[-1]:
                    ordered[-1]["tool_calls"].append(piece.openai_call())
                else:
                    ordered.append({"tool_calls": [piece.openai_call()]})
            elif piece.kind == REASONING_PIECE:
                ordered.append({"reasoning_content": piece.text, "reasoning": piece.text})
            else:
                ordered.append({"content": piece.text})
        return ordered

    def finish_reason(self, key: tuple[int, int], reason: str | None) -> str | None:
        """A choice's finish reason: "tool_calls" when the model stopped after calling."""
        reader = self.readers.get(key)
        return reader.finish_reason(reason) if reader is not None else reason


class ResponseWriter:
    """Formats the responses of one server: `token_bytes(id, text)` gives a token's own
    bytes (its text is its Logprob's `decoded_token`)."""

    def __init__(self, model_name: str, token_bytes: Callable[[int, str], bytes],
                 decode_token: Callable[[int], str] = str, special_ids: frozenset[int] = frozenset()):
        """`decode_token(id)`: a token's text alone (the prompt's first token, which has no
        logprob entry to carry it); `special_ids`: tokens that have no text in an echoed
        prompt (BOS), so take no room in its text offsets."""
        self.model_name = model_name
        self.token_bytes = token_bytes
        self.decode_token = decode_token
        self.special_ids = special_ids

    def delta_chunk(self, job: ChatJob, prompt_index: int, c, choices: ChoiceStates) -> dict | None:
        """The chunk of a "delta" completion output, or None when it brings nothing to send."""
        key = (prompt_index, c.index)
        if key in choices.finished:
            return None  # its finish chunk went out already
        if c.finish_reason is not None:
            choices.finished.add(key)
        if not (c.delta_text or c.finish_reason or (c.token_ids and (job.want_logprobs or job.return_token_ids))):
            return None
        content = choices.delta(job, key, c) if job.chat else c.delta_text
        held_back = job.reasoning_parser is not None or job.tools is not None
        if content == {"content": ""} and held_back and not (
                c.finish_reason or (c.token_ids and (job.want_logprobs or job.return_token_ids))):
            return None  # (its text waits: it may begin `</think>` or a call)
        logprobs = self.logprobs(job, c, 0, choices.offsets[key])
        if logprobs and not job.chat:
            choices.offsets[key] += sum(len(text) for text in logprobs["tokens"])
        chunk = self.chunk(job, prompt_index * job.n + c.index, content, choices.finish_reason(key, c.finish_reason),
                           logprobs)
        if job.return_token_ids:
            chunk["choices"][0]["token_ids"] = list(c.token_ids)  # this chunk's tokens
        return chunk

    def envelope(self, job: ChatJob, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if job.chat else "text_completion"
        return {"id": job.request_id, "object": kind, "created": job.created, "model": self.model_name}

    def chunk(self, job: ChatJob, index: int, content, finish_reason, logprobs) -> dict:
        choice = {"index": index, "logprobs": logprobs, "finish_reason": finish_reason}
        choice["delta" if job.chat else "text"] = content
        chunk = {**self.envelope(job, chunk=True), "choices": [choice]}
        if job.include_usage:
            chunk["usage"] = None  # as OpenAI: the usage comes in the last chunk alone
        return chunk

    def response(self, job: ChatJob, finals: list[RequestOutput]) -> dict:
        choices = []
        for prompt_index, out in enumerate(finals):
            for c in out.outputs:
                if job.prompt_only:  # (the one token the engine made is not part of the answer)
                    c = replace(c, text="", token_ids=[], logprobs=None if c.logprobs is None else [])
                echo_part = self.echo_logprobs(job, out) if job.echo_logprobs else None
                logprobs = self.logprobs(job, c, 0, len(job.echo_texts[prompt_index]) if echo_part else 0)
                if echo_part is not None:
                    logprobs = {key: echo_part[key] + (logprobs or {}).get(key, []) for key in echo_part}
                choice = {"index": prompt_index * job.n + c.index, "finish_reason": c.finish_reason,
                          "stop_reason": c.stop_reason, "logprobs": logprobs}
                if job.chat:
                    choice["message"] = self.message(job, c.text, c.finish_reason)
                    choice["finish_reason"] = choice["message"].pop("finish_reason")
                else:
                    echo = job.echo_texts[prompt_index] if job.echo_texts is not None else ""
                    choice["text"] = echo + c.text
                    if job.prompt_logprobs is not None:
                        choice["prompt_logprobs"] = self.prompt_logprobs(out, job.prompt_logprobs)
                if job.return_token_ids:
                    choice["token_ids"] = list(c.token_ids)
                    if not job.chat:
                        choice["prompt_token_ids"] = list(out.prompt_token_ids)
                choices.append(choice)
        generated = 0 if job.prompt_only else sum(len(c.token_ids) for out in finals for c in out.outputs)
        body = {**self.envelope(job, chunk=False), "choices": choices, "usage": usage(job, generated)}
        if job.return_token_ids and job.chat:
            body["prompt_token_ids"] = list(finals[0].prompt_token_ids)
        if job.prompt_logprobs is not None and job.chat:
            body["prompt_logprobs"] = self.prompt_logprobs(finals[0], job.prompt_logprobs)
        return body

    @staticmethod
    def message(job: ChatJob, text: str, finish_reason: str | None) -> dict:
        """A chat choice's message of its whole answer (with its "finish_reason", for the
        choice): its content, on a reasoning model its reasoning apart, with tools the
        calls read from it as OpenAI's `tool_calls` (content the text around them, null
        when none; finish_reason "tool_calls" when the model stopped after them); a
        would-be call that does not parse stays in the content."""
        answer = read_answer(text, finish_reason, job.reasoning_parser, job.prompt_text, job.tools)
        message = {"role": "assistant", "content": answer.content, "finish_reason": answer.finish_reason}
        if job.reasoning_parser is not None:
            message.update(reasoning_content=answer.reasoning, reasoning=answer.reasoning)
        if answer.calls:
            message["content"] = answer.content or None
            message["tool_calls"] = [{"id": call_id, "type": "function",
                                      "function": {"name": call.name,
                                                   "arguments": json.dumps(call.arguments, ensure_ascii=False)}}
                                     for call_id, call in zip(answer.call_ids, answer.calls)]
        return message

    def echo_logprobs(self, job: ChatJob, out: RequestOutput) -> dict:
        """The prompt's tokens in OpenAI's legacy completions logprobs (echo): the first has
        no logprob (null), each other its own and the top `logprobs` at its place."""
        ids, entries, k = out.prompt_token_ids, out.prompt_logprobs or [None], job.num_top_logprobs
        texts = [self.decode_token(ids[0]), *(e[t].decoded_token for t, e in zip(ids[1:], entries[1:]))]
        offsets, at = [], 0
        for token_id, text in zip(ids, texts):
            offsets.append(at)
            at += 0 if token_id in self.special_ids else len(text)
        return {"tokens": texts,
                "token_logprobs": [None, *(finite(e[t].logprob) for t, e in zip(ids[1:], entries[1:]))],
                "top_logprobs": [None, *({v.decoded_token: finite(v.logprob) for _, v in [*top(e, k), (t, e[t])]}
                                         for t, e in zip(ids[1:], entries[1:]))],
                "text_offset": offsets}

    @staticmethod
    def prompt_logprobs(out: RequestOutput, k: int) -> list | None:
        """vLLM's prompt_logprobs field: per prompt token, None (the first) or {token id:
        {logprob, rank, decoded_token}} of the token and the top `k`."""
        if out.prompt_logprobs is None:
            return None
        return [None if entry is None else {
            str(t): {"logprob": finite(v.logprob), "rank": v.rank, "decoded_token": v.decoded_token}
            for t, v in entry.items() if t == token or v.rank is not None and v.rank <= k}
            for token, entry in zip(out.prompt_token_ids, out.prompt_logprobs)]

    def logprobs(self, job: ChatJob, completion, start: int, text_offset: int = 0):
        """Logprobs of the completion's tokens from `start` on; `text_offset` is where the
        first one's text begins (completions only)."""
        if not job.want_logprobs or completion.logprobs is None:
            return None
        ids, entries = completion.token_ids[start:], completion.logprobs[start:]
        k = job.num_top_logprobs
        if job.chat:
            def item(token_id, logprob):
                text = logprob.decoded_token
                return {"token": text, "logprob": finite(logprob.logprob),
                        "bytes": list(self.token_bytes(token_id, text))}
            return {"content": [{**item(t, e[t]), "top_logprobs": [item(i, v) for i, v in top(e, k)]}
                                for t, e in zip(ids, entries)]}
        texts = [e[t].decoded_token for t, e in zip(ids, entries)]
        offsets, at = [], text_offset
        for text in texts:
            offsets.append(at)
            at += len(text)
        return {"tokens": texts, "token_logprobs": [finite(e[t].logprob) for t, e in zip(ids, entries)],
                # (with the sampled token's, as OpenAI's legacy completions: up to logprobs + 1)
                "top_logprobs": [{v.decoded_token: finite(v.logprob) for _, v in [*top(e, k), (t, e[t])]}
                                 for t, e in zip(ids, entries)],
                "text_offset": offsets}


#: What a logprob of -inf (a token a constraint or a ban refused) reads as on the wire:
#: JSON has no infinities (vLLM sends the same number).
MIN_LOGPROB = -9999.0


def finite(logprob: float) -> float:
    return logprob if logprob > MIN_LOGPROB else MIN_LOGPROB


def top(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The k most likely tokens of a logprobs entry (which also holds the sampled token)."""
    return sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:k]


def usage(job: ChatJob, completion_tokens: int) -> dict:
    return {"prompt_tokens": job.prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": job.prompt_tokens + completion_tokens}


def overall_reason(finals: list[RequestOutput]) -> str:
    reasons = {c.finish_reason for out in finals for c in out.outputs}
    return "length" if "length" in reasons else "stop"


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
