"""LLM: the offline API, a synchronous face over an EngineClient whose core runs in this
process (or, with core_process=True, in a child process); `generate` steps it until
every prompt ends."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence

from gristmill import startup
from gristmill.chat.answer import constrain, read_answer
from gristmill.chat.tool_choice import ToolRequest, tool_request
from gristmill.config import EngineConfig
from gristmill.engine.client import EngineClient, EngineFace, InprocCore, stepped_in_child_process
from gristmill.engine.core import EngineCore
from gristmill.errors import EngineDeadError, GenerationError, RequestError, error_string
from gristmill.lora import LoRARequest, as_lora_request
from gristmill.outputs import (POOLING_OUTPUT_CLASSES, ClassificationRequestOutput, CompletionOutput,
                               EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput, ScoringOutput,
                               ScoringRequestOutput)
from gristmill.pooling_params import PoolingParams
from gristmill.pooling_tasks import check_generates, cosine
from gristmill.prompts import is_token_ids, prompt_item, score_pairs
from gristmill.sampling import SamplingParams

Prompt = str | list[int]


class LLM(EngineFace):
    """Offline generation over the engine.

    >>> llm = LLM()  # the bundled Gemma 3 270M
    >>> llm.generate("The capital of France is", SamplingParams(max_tokens=8, temperature=0))

    Keyword arguments are `EngineConfig` fields (max_model_len, block_size, ...).
    A prompt that fails validation or fails inside the engine comes back as an output
    with finish_reason "error" and `error` set; only EngineDeadError is raised.

    `core_process=True` runs the engine core in a child process (as `AsyncEngine` does),
    which imports torch and loads the model while this process loads the tokenizer: a
    warm start takes about the longer of the two, not their sum, and this process never
    imports torch (what `gristmill generate` runs). A core that fails to start raises
    EngineDeadError, within about a second of its death; `core` and `reset_prefix_cache`
    need the core in this process.
    """

    def __init__(self, model: str | None = None, *, core_process: bool = False, **engine_options):
        started = time.monotonic()
        config = EngineConfig.from_kwargs(model=model, **engine_options)
        #: The engine: tokenizer, input and output processing, and its core, which runs in
        #: this process or a child's (`generate` steps it until every prompt ends).
        self.client = EngineClient(config, stepped_in_child_process() if core_process else None,
                                   tokenizer_beside_core=core_process)
        if core_process:
            self.client.core.start()
        self._ids = itertools.count()
        # One generate/chat at a time: two threads stepping one core would corrupt it.
        self._lock = threading.Lock()
        #: Seconds the engine took to start (converting, quantizing, compiling, loading).
        self.start_seconds = time.monotonic() - started
        startup.logger.info("engine ready in %.1f s", self.start_seconds)

    @property
    def core(self) -> EngineCore:
        """The engine core (it runs in this process, unless core_process=True)."""
        if not isinstance(self.client.core, InprocCore):
            raise RequestError("this LLM's engine core runs in a child process (core_process=True); create the "
                               "LLM without core_process to reach its core", param="core_process")
        return self.client.core.engine_core

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Generate for one prompt or a list (strings or token-id lists); one output each,
        in order. `sampling_params` is one for all prompts or one per prompt; None takes
        the model's generation_config.json as vLLM does: its temperature, top_p, top_k,
        min_p, repetition_penalty and max_new_tokens (as max_tokens) over SamplingParams()
        (`get_default_sampling_params`). A list of ints is one prompt of token ids. A
        prompt may also be a dict as vLLM takes it: {"prompt": text} or
        {"prompt_token_ids": [ids]}. `lora_request`: the LoRA adapter to run with (an engine
        started with enable_lora), one for all prompts or one (or None) per prompt."""
        if prompts is None:
            raise RequestError("prompts is None; pass a prompt (a string or a list of token ids) or a list of "
                               "prompts", param="prompt")
        if isinstance(prompts, (str, bytes, dict)) or is_token_ids(prompts):
            prompts = [prompts]
        return self._run([prompt_item(p) for p in prompts], sampling_params, use_tqdm, lora_request=lora_request)

    def chat(self, conversations: list[dict] | Sequence[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template: str | None = None, chat_template_kwargs: dict | None = None,
             tools: list[dict] | None = None, tool_choice: str | dict | None = None,
             parallel_tool_calls: bool | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate a reply to each conversation (a list of {"role", "content"} messages),
        rendered with the model's chat template (or `chat_template`, a Jinja text), as vLLM's
        LLM.chat: `continue_final_message` continues the last (assistant) message, left
        open (with add_generation_prompt=False); `chat_template_kwargs` are more variables
        for the template (Qwen3's `enable_thinking`). On a reasoning model
        (`reasoning_parser`) each completion's `reasoning` holds its reasoning and `text`
        only its answer.

        `tools` (OpenAI tool entries), `tool_choice` ("none", "auto", "required" or
        {"type": "function", "function": {"name": ...}}) and `parallel_tool_calls`, as the
        chat completions API takes them, apply to every conversation: the template writes
        the tools, a forced call ("required", a named function) is written by the grammar
        engine, so its arguments always match the function's schema, and each completion's
        `tool_calls` holds the calls read from its answer (ToolCall: `name`, `arguments` a
        dict; an empty list when it made none), `text` the text around them and
        finish_reason "tool_calls" when it stopped after calling. Malformed tool fields
        are each conversation's error, as other invalid input is."""
        if isinstance(conversations, (str, bytes, dict)) or (
                conversations and isinstance(conversations[0], dict)):
            conversations = [conversations]  # one conversation (a str is one, malformed)
        try:
            tool_req, tools_error = tool_request(tools, tool_choice, parallel_tool_calls, self.tool_parser), None
        except RequestError as exc:
            tool_req, tools_error = None, exc
        items = []
        for messages in conversations:
            try:
                if tools_error is not None:
                    raise tools_error
                text = self.apply_chat_template(messages, add_generation_prompt, continue_final_message,
                                                chat_template, chat_template_kwargs,
                                                tools=tool_req.tools if tool_req is not None else None)
                items.append((text, None))
            except RequestError as exc:
                items.append((None, exc))
        if tool_req is not None and tool_req.parser is not None:
            sampling_params, items = self._tool_constraints(tool_req, sampling_params, items)
        results = self._run(items, sampling_params, use_tqdm, add_special_tokens=False, chat=True,
                            lora_request=lora_request)
        for (prompt_text, _), result in zip(items, results):
            for output in result.outputs:
                if output.finish_reason == "error":
                    continue
                answer = read_answer(output.text, output.finish_reason, self.reasoning_parser, prompt_text, tool_req)
                if self.reasoning_parser is not None:
                    output.reasoning = answer.reasoning
                output.text, output.finish_reason = answer.content, answer.finish_reason
                if tool_req is not None:
                    output.tool_calls = answer.calls
        return results

    def _tool_constraints(self, tool_req: ToolRequest, sampling_params, items: list) -> tuple[list, list]:
        """One SamplingParams per conversation whose constraint writes its calls (a forced
        call's grammar, or under "auto" the grammar that holds once a call starts); a
        forced call in a conversation whose params constrain the answer already is an
        error (one of the two)."""
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = _params_per_prompt(sampling_params, len(items))
        forced, checked = [], []
        for params, (text, error) in zip(params_list, items):
            if error is None:
                try:
                    params = constrain(params, tool_req)
                except RequestError as exc:
                    error = exc
            forced.append(params)
            checked.append((text if error is None else None, error))
        return forced, checked

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, chat_template: str | None = None,
                            chat_template_kwargs: dict | None = None, tools: list[dict] | None = None) -> str:
        from gristmill.tokenizer import render_chat
        return render_chat(self.tokenizer, messages, add_generation_prompt, continue_final_message,
                           chat_template_kwargs, chat_template, tools)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix (as vLLM's `LLM.reset_prefix_cache`), so the
        next prompts are computed whole: for timing a cold cache, or comparing outputs
        with and without it. True once done; False if another thread's generate is
        running, and then nothing changes."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            return self.core.reset_prefix_cache()
        finally:
            self._lock.release()

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` sample with when given no SamplingParams, as vLLM's:
        SamplingParams() with the fields the model directory's generation_config.json sets
        of temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens (as
        max_tokens). Nothing else of the file is read (not do_sample, as in vLLM), and
        SamplingParams that are passed are used as given. A new object each call."""
        try:
            return SamplingParams(**self.client.generation_defaults)
        except RequestError as exc:
            raise RequestError(f"{self.model_dir / 'generation_config.json'} gives an invalid default: {exc}; "
                               f"fix the file or pass SamplingParams", param=exc.param) from None

    # -- pooling engines (task embed, classify, score) ------------------------------

    def embed(self, prompts: Prompt | Sequence[Prompt], pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              *, truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[EmbeddingRequestOutput]:
        """An embedding of each prompt, in order (`outputs.embedding`, a list of floats), as
        vLLM's LLM.embed; needs an engine whose task is embed (or score, by an embedding
        model). `pooling_params`: one for all prompts or one per prompt (`dimensions`,
        `normalize`, `truncate_prompt_tokens`). A prompt that fails comes back with
        finish_reason "error" and `error` set, `outputs` None."""
        return self._pool(prompts, pooling_params, "embed", truncate_prompt_tokens, use_tqdm, lora_request=lora_request)

    def classify(self, prompts: Prompt | Sequence[Prompt],
                 pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *,
                 truncate_prompt_tokens: int | None = None, use_tqdm: bool = True) -> list[ClassificationRequestOutput]:
        """Label probabilities of each prompt (`outputs.probs`, in the model's id2label
        order), as vLLM's LLM.classify; needs a sequence classifier (task classify)."""
        return self._pool(prompts, pooling_params, "classify", truncate_prompt_tokens, use_tqdm)

    def encode(self, prompts: Prompt | Sequence[Prompt],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *,
               truncate_prompt_tokens: int | None = None, use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """What the model's pooler gives for each prompt, as a float32 numpy array
        (`outputs.data`): an embedding or a classifier's probabilities."""
        return self._pool(prompts, pooling_params, "encode", truncate_prompt_tokens, use_tqdm)

    def score(self, data_1: Prompt | Sequence[Prompt], data_2: Prompt | Sequence[Prompt],
              pooling_params: PoolingParams | None = None, *, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True) -> list[ScoringRequestOutput]:
        """How well each text of `data_2` goes with `data_1` (one text against each, or
        the i-th with the i-th), as vLLM's LLM.score: `outputs.score` is a cross-encoder's
        relevance (task score: a classifier with one label, reading each pair at once), or
        the cosine of the two texts' embeddings (an embedding model)."""
        firsts, seconds = _score_pairs(data_1, data_2)
        self.client.check_pooling("score")
        if self.capacity.pooler.head == "embed":
            return self._score_by_cosine(firsts, seconds, pooling_params, truncate_prompt_tokens, use_tqdm)
        items = [(first, second) for first, second in zip(firsts, seconds)]
        return self._pool(items, pooling_params, "score", truncate_prompt_tokens, use_tqdm, pairs=True)

    def _score_by_cosine(self, firsts, seconds, pooling_params, truncate_prompt_tokens, use_tqdm):
        texts = list({_prompt_key(t): t for t in [*firsts, *seconds]}.values())
        params = (pooling_params or PoolingParams()).clone(normalize=True)
        embedded = dict(zip(map(_prompt_key, texts),
                            self._pool(texts, params, "embed", truncate_prompt_tokens, use_tqdm)))
        results = []
        for first, second in zip(firsts, seconds):
            a, b = embedded[_prompt_key(first)], embedded[_prompt_key(second)]
            result = ScoringRequestOutput(str(next(self._ids)), None, a.prompt_token_ids + b.prompt_token_ids)
            failed = a if a.error else b if b.error else None
            if failed is not None:
                result.finish_reason, result.error = "error", failed.error
            else:
                result.finish_reason = "stop"
                result.outputs = ScoringOutput(cosine(a.outputs.embedding, b.outputs.embedding))
            results.append(result)
        return results

    def _pool(self, prompts, pooling_params, kind: str, truncate_prompt_tokens, use_tqdm: bool, pairs: bool = False,
              lora_request=None):
        if prompts is None:
            raise RequestError("prompts is None; pass a text, a list of token ids or a list of them", param="prompt")
        if not pairs and (isinstance(prompts, (str, bytes, dict)) or is_token_ids(prompts)):
            prompts = [prompts]
        prompts = list(prompts)
        self.client.check_pooling(kind)
        params_list = _params_per_prompt(PoolingParams() if pooling_params is None else pooling_params, len(prompts),
                                         PoolingParams)
        if truncate_prompt_tokens is not None:
            params_list = [p.clone(truncate_prompt_tokens=truncate_prompt_tokens) for p in params_list]
        loras = self._loras_per_prompt(lora_request, len(prompts))
        if self.dead_error is not None:
            raise EngineDeadError(self.dead_error.message)
        with self._lock:
            try:
                # Added shortest first, as sentence-transformers sorts its batches: a step's
                # sequences are then of near lengths, and its attention pads few rows.
                results = [None] * len(prompts)
                for i in sorted(range(len(prompts)), key=lambda i: _prompt_size(prompts[i])):
                    results[i] = self._add_pooling(prompts[i], params_list[i], kind, pairs, loras[i])
                self._step_until_done(len(results), sum(r.finished for r in results), use_tqdm, kind)
                return results
            except BaseException:
                self.client.abort_all()
                raise

    def _add_pooling(self, prompt, params: PoolingParams, kind: str, pair: bool, lora=None) -> PoolingRequestOutput:
        request_id = str(next(self._ids))
        second = None
        if pair:
            prompt, second = prompt
        prompt, invalid = prompt_item(prompt)
        try:
            if invalid is not None:
                raise invalid
            return self.client.add_pooling(prompt, params, request_id, kind, pair=second, lora=lora).output
        except (RequestError, GenerationError) as exc:
            return POOLING_OUTPUT_CLASSES[kind](request_id, prompt if isinstance(prompt, str) else None, [],
                                                finish_reason="error", error=error_string(exc))

    def get_tokenizer(self):
        """The tokenizer (a transformers tokenizer), as vLLM's LLM.get_tokenizer()."""
        return self.tokenizer

    # -- the loop --------------------------------------------------------------

    def _run(self, items, sampling_params, use_tqdm: bool, add_special_tokens: bool = True, chat: bool = False,
             lora_request=None):
        if self.dead_error is not None:
            raise EngineDeadError(self.dead_error.message)
        check_generates(self.capacity, "LLM.generate / LLM.chat")
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = _params_per_prompt(sampling_params, len(items))
        loras = self._loras_per_prompt(lora_request, len(items))
        with self._lock:
            if self.dead_error is not None:  # (another thread's call saw it die)
                raise EngineDeadError(self.dead_error.message)
            try:
                return self._run_locked(items, params_list, use_tqdm, add_special_tokens, chat, loras)
            except BaseException:
                # Ctrl-C, or anything else that leaves this call early: nothing of it may
                # stay in the engine (its KV blocks, or steps run for it by the next call).
                self.client.abort_all()
                raise

    def _run_locked(self, items, params_list, use_tqdm: bool, add_special_tokens: bool, chat: bool, loras: list):
        results = [self._add(prompt, params, early_error, add_special_tokens, chat, lora)
                   for (prompt, early_error), params, lora in zip(items, params_list, loras)]
        self._step_until_done(len(results), sum(r.finished for r in results), use_tqdm, "generate")
        return results

    def _step_until_done(self, total: int, done: int, use_tqdm: bool, what: str) -> None:
        bar = _progress_bar(total, use_tqdm, what)
        bar.update(done)
        try:
            while self.client.has_unfinished:
                delivered = self.client.step()
                if use_tqdm:
                    bar.update(len(delivered))  # ("final" outputs: handed out once, finished)
        finally:
            bar.close()

    def _loras_per_prompt(self, lora_request, count: int) -> list[LoRARequest | None]:
        """One LoRARequest (or None) per prompt, from one for all or a list; RequestError
        when the engine has no LoRA or the list does not fit."""
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * count
        elif isinstance(lora_request, (list, tuple)) and len(lora_request) == count:
            loras = [as_lora_request(lora) for lora in lora_request]
        else:
            raise RequestError(f"lora_request must be a LoRARequest, None, or a list with one (or None) per prompt "
                               f"({count}), got {type(lora_request).__name__}"
                               f"{f' of {len(lora_request)}' if isinstance(lora_request, (list, tuple)) else ''}",
                               param="lora_request")
        for lora in loras:
            self.client.check_lora(lora)
        return loras

    def _add(self, prompt, params: SamplingParams, early_error, add_special_tokens, chat: bool,
             lora: LoRARequest | None = None) -> RequestOutput:
        """The request's output: the client's, filled in as it runs; one that is refused
        before it reaches the engine ends at once with its error. `chat`: `prompt` is a
        rendered chat (on a reasoning model, a constraint applies after the reasoning)."""
        request_id = str(next(self._ids))
        num_outputs = 1
        try:
            params.ensure_valid()  # (fields assigned after it was made: n sizes the output)
            num_outputs = params.n
            if early_error is not None:
                raise early_error
            # Handed out only once finished: its text is decoded at its end, and the core
            # sends its tokens then, not every step.
            return self.client.add(prompt, params, request_id, output_kind="final",
                                   add_special_tokens=add_special_tokens, token_times=False,
                                   chat_prompt=prompt if chat else None, lora=lora).output
        except (RequestError, GenerationError) as exc:
            result = RequestOutput(request_id, prompt if isinstance(prompt, str) else None, [],
                                   [CompletionOutput(i) for i in range(num_outputs)])
            for output in result.outputs:
                output.finish_reason, output.error = "error", error_string(exc)
            return result


def _params_per_prompt(given, count: int, kind: type = SamplingParams) -> list:
    """One `kind` (SamplingParams or PoolingParams) per prompt, from one for all or a list."""
    name = "sampling_params" if kind is SamplingParams else "pooling_params"
    if isinstance(given, kind):
        return [given] * count
    if isinstance(given, (dict, str, bytes)):
        raise RequestError(f"{name} must be a {kind.__name__} or a list of them, got {type(given).__name__}; "
                           f"e.g. {kind.__name__}(**your_dict)", param=name)
    params = list(given)
    if len(params) != count:
        raise RequestError(f"got {len(params)} {kind.__name__} for {count} prompts; pass one for "
                           f"all prompts or exactly one per prompt", param=name)
    bad = next((p for p in params if not isinstance(p, kind)), None)
    if bad is not None:
        raise RequestError(f"{name} must be {kind.__name__}, got a {type(bad).__name__} in the list; "
                           f"e.g. {kind.__name__}(**your_dict)", param=name)
    return params


class _NoBar:
    def update(self, n):
        pass

    def close(self):
        pass


def _progress_bar(total: int, use_tqdm: bool, what: str):
    if not use_tqdm or total < 2:
        return _NoBar()
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=what, unit="prompt")


def _score_pairs(data_1, data_2) -> tuple[list, list]:
    """The (first, second) texts `LLM.score` scores: one against each, or i-th with i-th."""
    def as_list(data, name):
        if data is None:
            raise RequestError(f"{name} is None; pass a text or a list of texts", param=name)
        return [data] if isinstance(data, (str, bytes, dict)) or is_token_ids(data) else list(data)

    return score_pairs(as_list(data_1, "data_1"), as_list(data_2, "data_2"), ("data_1", "data_2"))


def _prompt_size(prompt) -> int:
    """About how long a prompt is before it is tokenized: its characters, token ids, or
    both texts of a pair."""
    if isinstance(prompt, tuple):
        return sum(map(_prompt_size, prompt))
    if isinstance(prompt, dict):
        prompt = prompt.get("prompt", prompt.get("prompt_token_ids", ""))
    return len(prompt) if isinstance(prompt, (str, bytes, list)) else 0


def _prompt_key(prompt) -> object:
    return prompt if isinstance(prompt, str) else repr(prompt)
