"""The pooling endpoints over a pooling engine (task embed, classify or score):
/v1/embeddings, /v1/classify, /v1/score and /v1/rerank (/v2/rerank).

A request's inputs are all submitted before any is awaited and it is answered whole: an
input that fails fails the request (its error in the usual envelope), and the others
are aborted. Scores come from a cross-encoder reading each pair at once (a classifier
with one label), or, with an embedding model, from the cosine of the two embeddings.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse

from gristmill.engine.async_engine import LONG_PROMPT_CHARS, AsyncEngine
from gristmill.errors import RequestError
from gristmill.lora import LoRARequest
from gristmill.outputs import PoolingRequestOutput
from gristmill.pooling_params import PoolingParams
from gristmill.pooling_tasks import check_task, cosine
from gristmill.prompts import score_pairs
from gristmill.server.limits import ServerLimits, at_most
from gristmill.server.metrics import RequestTimer, ServerMetrics
from gristmill.server.openai_serving import OpenAIServing
from gristmill.server.serving import ClientDisconnected, until_disconnect
from gristmill.server.pooling_protocol import (ClassificationRequest, EmbeddingRequest, RerankRequest,
                                               ScoreRequest)


class PoolingServing:
    def __init__(self, engine: AsyncEngine, model_name: str, metrics: ServerMetrics, limits: ServerLimits,
                 serving: OpenAIServing):
        """`serving`: the generation endpoints', whose model check and error responses
        (with Retry-After while the engine restarts) these share."""
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics
        self.limits = limits
        self._check_model = serving.check_model
        self._error_response = serving.error_response

    # -- entry points -----------------------------------------------------------------

    async def embeddings(self, body: EmbeddingRequest, request: Request):
        async def answer():
            lora = self._check(body, "/v1/embeddings", "embed")
            params = PoolingParams(dimensions=body.dimensions, normalize=body.normalize,
                                   truncate_prompt_tokens=body.truncate_prompt_tokens)
            outs = await self._pool(request, [(p, None) for p in self._inputs(body.input)], params, "embed",
                                    body.add_special_tokens, lora)
            data = [{"object": "embedding", "index": i,
                     "embedding": _encoded(out.outputs.embedding, body.encoding_format)} for i, out in enumerate(outs)]
            return {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                    "model": self.model_name, "data": data, "usage": _usage(outs)}
        return await self._answer(answer)

    async def classify(self, body: ClassificationRequest, request: Request):
        async def answer():
            lora = self._check(body, "/v1/classify", "classify")
            params = PoolingParams(use_activation=body.use_activation,
                                   truncate_prompt_tokens=body.truncate_prompt_tokens)
            outs = await self._pool(request, [(p, None) for p in self._inputs(body.input)], params, "classify",
                                    body.add_special_tokens, lora)
            labels = self.engine.capacity.pooler.labels
            data = []
            for i, out in enumerate(outs):
                probs = out.outputs.probs
                best = int(np.argmax(probs))
                data.append({"index": i, "label": labels[best] if labels else str(best), "probs": probs,
                             "num_classes": len(probs)})
            return {"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                    "model": self.model_name, "data": data, "usage": _usage(outs)}
        return await self._answer(answer)

    async def score(self, body: ScoreRequest, request: Request):
        async def answer():
            lora = self._check(body, "/v1/score", "score")
            texts = [[t] if isinstance(t, str) else list(t) for t in (body.firsts, body.seconds)]
            firsts, seconds = score_pairs(*texts, ("text_1", "text_2"))
            self._bound(firsts + seconds, "text_2")
            scores, outs = await self._scores(request, body, firsts, seconds, lora)
            data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
            return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                    "model": self.model_name, "data": data, "usage": _usage(outs)}
        return await self._answer(answer)

    async def rerank(self, body: RerankRequest, request: Request):
        async def answer():
            lora = self._check(body, request.url.path, "score")
            documents = body.document_texts()
            self._bound([body.query, *documents], "documents")
            scores, outs = await self._scores(request, body, [body.query] * len(documents), documents, lora)
            order = sorted(range(len(documents)), key=lambda i: -scores[i])[:body.top_n or None]
            results = []
            for i in order:
                result = {"index": i, "relevance_score": scores[i]}
                if body.return_documents:
                    result["document"] = {"text": documents[i]}
                results.append(result)
            return {"id": f"rerank-{uuid.uuid4().hex}", "model": self.model_name,
                    "usage": {"total_tokens": _usage(outs)["total_tokens"]}, "results": results}
        return await self._answer(answer)

    # -- shared -----------------------------------------------------------------------

    async def _answer(self, answer):
        timer = RequestTimer(self.metrics)
        try:
            body = await answer()
        except ClientDisconnected:
            timer.disconnected()
            return JSONResponse({}, status_code=499)
        except Exception as exc:  # noqa: BLE001 - every failure is an error envelope
            timer.failed(exc)
            return self._error_response(exc)
        timer.num_prompt_tokens = body.get("usage", {}).get("total_tokens", 0)
        timer.finished("stop")
        return JSONResponse(body)

    def _check(self, body, path: str, kind: str) -> LoRARequest | None:
        """The model it names is served (the LoRA adapter it names, or None), the engine
        is up and runs a task that answers `path`; no field it cannot honour is set."""
        lora = self._check_model(body.model)
        unsupported = body.unsupported_field()
        if unsupported is not None:
            raise RequestError(f"{unsupported} would change the output and is not supported by this server; leave "
                               f"it out", param=unsupported)
        misplaced = body.misplaced_field()
        if misplaced is not None:
            raise RequestError(f"{misplaced} does not apply to {path}; leave it out", param=misplaced)
        check_task(kind, self.engine.capacity, what=path)
        return lora

    def _inputs(self, given) -> list:
        inputs = [given] if isinstance(given, str) or (given and isinstance(given[0], int)) else list(given)
        if not inputs:
            raise RequestError("input is empty; send a text, a list of texts, token ids or a list of them",
                               param="input")
        self._bound(inputs, "input")
        return inputs

    def _bound(self, inputs: list, field: str) -> None:
        at_most(len(inputs), self.limits.max_inputs, field, "inputs", "max-inputs")
        for text in inputs:
            if isinstance(text, str):
                at_most(len(text), self.limits.max_prompt_chars, field, "characters in one input",
                        "max-prompt-chars")

    async def _pool(self, request: Request, items: list, params: PoolingParams, kind: str,
                    add_special_tokens: bool = True, lora: LoRARequest | None = None) -> list[PoolingRequestOutput]:
        """Every (input, pair) of a request through the engine; their outputs in order."""
        prefix, streams = uuid.uuid4().hex, []
        try:
            for i, (prompt, pair) in enumerate(items):
                ids = types = None
                if isinstance(prompt, str) and len(prompt) + len(pair or "") > LONG_PROMPT_CHARS:
                    ids, types = await asyncio.to_thread(self.engine.inputs.tokenize_for_pooling, prompt, params,
                                                         add_special_tokens, pair)
                streams.append(self.engine.add_pooling_request(
                    prompt, params, f"{prefix}-{i}", kind=kind, text_pair=pair, add_special_tokens=add_special_tokens,
                    prompt_token_ids=ids, token_type_ids=types, lora_request=lora))

            async def final(stream):
                async for out in stream:
                    pass
                return out

            return await until_disconnect(request, asyncio.gather(*(final(s) for s in streams)))
        finally:
            for stream in streams:
                await stream.aclose()

    async def _scores(self, request: Request, body, firsts: list[str], seconds: list[str],
                      lora: LoRARequest | None = None):
        """(score of each pair, the outputs whose tokens it cost)."""
        truncate = body.truncate_prompt_tokens
        if self.engine.capacity.pooler.head == "classify":  # a cross-encoder: each pair at once
            params = PoolingParams(use_activation=body.use_activation, truncate_prompt_tokens=truncate)
            outs = await self._pool(request, list(zip(firsts, seconds)), params, "score", body.add_special_tokens,
                                    lora)
            return [out.outputs.score for out in outs], outs
        if body.use_activation is not None:
            raise RequestError("use_activation applies to a cross-encoder's scores; this server's model gives "
                               "embeddings, scored by their cosine", param="use_activation")
        texts = list(dict.fromkeys([*firsts, *seconds]))
        params = PoolingParams(normalize=True, truncate_prompt_tokens=truncate)
        outs = await self._pool(request, [(t, None) for t in texts], params, "embed", body.add_special_tokens, lora)
        vectors = dict(zip(texts, (out.outputs.embedding for out in outs)))
        return [cosine(vectors[a], vectors[b]) for a, b in zip(firsts, seconds)], outs


def _encoded(vector: list[float], encoding_format: str):
    if encoding_format == "base64":  # OpenAI's: the float32 values' little-endian bytes
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


def _usage(outs: list[PoolingRequestOutput]) -> dict:
    tokens = sum(len(out.prompt_token_ids) for out in outs)
    return {"prompt_tokens": tokens, "total_tokens": tokens}
