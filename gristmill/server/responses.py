"""OpenAI response bodies and stream chunks, built from engine outputs."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from gristmill.engine.stream import RequestStream
from gristmill.outputs import Logprob, RequestOutput


@dataclass
class Job:
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


class ChoiceStates:
    """What a stream has sent of each (prompt, completion) choice."""

    def __init__(self, num_prompts: int, n: int):
        self.finished: set[tuple[int, int]] = set()
        #: Each choice's next text_offset: counted over token texts, as the non-streamed
        #: response does, never over the text handed out so far (which lags behind
        #: while it may begin a stop string).
        self.offsets = {(p, i): 0 for p in range(num_prompts) for i in range(n)}


class ResponseWriter:
    """Formats the responses of one server: `token_bytes(id, text)` gives a token's own
    bytes (its text is its Logprob's `decoded_token`)."""

    def __init__(self, model_name: str, token_bytes: Callable[[int, str], bytes]):
        self.model_name = model_name
        self.token_bytes = token_bytes

    def delta_chunk(self, job: Job, prompt_index: int, c, choices: ChoiceStates) -> dict | None:
        """The chunk of a "delta" completion output, or None when it brings nothing to send."""
        key = (prompt_index, c.index)
        if key in choices.finished:
            return None  # its finish chunk went out already
        if c.finish_reason is not None:
            choices.finished.add(key)
        if not (c.delta_text or c.finish_reason or (c.token_ids and (job.want_logprobs or job.return_token_ids))):
            return None
        logprobs = self.logprobs(job, c, 0, choices.offsets[key])
        if logprobs and not job.chat:
            choices.offsets[key] += sum(len(text) for text in logprobs["tokens"])
        content = {"content": c.delta_text} if job.chat else c.delta_text
        chunk = self.chunk(job, prompt_index * job.n + c.index, content, c.finish_reason, logprobs)
        if job.return_token_ids:
            chunk["choices"][0]["token_ids"] = list(c.token_ids)  # this chunk's tokens
        return chunk

    def envelope(self, job: Job, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if job.chat else "text_completion"
        return {"id": job.request_id, "object": kind, "created": job.created, "model": self.model_name}

    def chunk(self, job: Job, index: int, content, finish_reason, logprobs) -> dict:
        choice = {"index": index, "logprobs": logprobs, "finish_reason": finish_reason}
        choice["delta" if job.chat else "text"] = content
        chunk = {**self.envelope(job, chunk=True), "choices": [choice]}
        if job.include_usage:
            chunk["usage"] = None  # as OpenAI: the usage comes in the last chunk alone
        return chunk

    def response(self, job: Job, finals: list[RequestOutput]) -> dict:
        choices = []
        for prompt_index, out in enumerate(finals):
            for c in out.outputs:
                choice = {"index": prompt_index * job.n + c.index, "finish_reason": c.finish_reason,
                          "stop_reason": c.stop_reason, "logprobs": self.logprobs(job, c, 0)}
                if job.chat:
                    choice["message"] = {"role": "assistant", "content": c.text}
                else:
                    echo = job.echo_texts[prompt_index] if job.echo_texts is not None else ""
                    choice["text"] = echo + c.text
                if job.return_token_ids:
                    choice["token_ids"] = list(c.token_ids)
                    if not job.chat:
                        choice["prompt_token_ids"] = list(out.prompt_token_ids)
                choices.append(choice)
        totals = usage(job, sum(len(c.token_ids) for out in finals for c in out.outputs))
        body = {**self.envelope(job, chunk=False), "choices": choices, "usage": totals}
        if job.return_token_ids and job.chat:
            body["prompt_token_ids"] = list(finals[0].prompt_token_ids)
        return body

    def logprobs(self, job: Job, completion, start: int, text_offset: int = 0):
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


def usage(job: Job, completion_tokens: int) -> dict:
    return {"prompt_tokens": job.prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": job.prompt_tokens + completion_tokens}


def overall_reason(finals: list[RequestOutput]) -> str:
    reasons = {c.finish_reason for out in finals for c in out.outputs}
    return "length" if "length" in reasons else "stop"


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
