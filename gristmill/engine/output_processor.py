"""OutputProcessor: engine-core updates -> RequestOutputs (text, stop strings, errors)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from gristmill import faults
from gristmill.engine.detokenizer import IncrementalDetokenizer
from gristmill.engine.messages import RequestUpdate
from gristmill.errors import GenerationError, error_string
from gristmill.outputs import CompletionOutput, Logprob, PoolingRequestOutput, RequestOutput, pooled_output
from gristmill.sampling import SamplingParams


@dataclass
class _Completion:
    parent: RequestOutput
    output: CompletionOutput
    detokenizer: IncrementalDetokenizer | None
    #: Tokens that end it (EOS unless ignore_eos, stop_token_ids): the one that ends it
    #: stays in its token ids but not in its text, as in vLLM.
    stop_tokens: frozenset[int]
    #: Its stop_token_ids (a stop_reason when one ends it; EOS is none).
    stop_token_ids: frozenset[int] = frozenset()


@dataclass
class _Pooled:
    """A pooling request: no text, one update, at its end."""

    parent: PoolingRequestOutput
    #: What its caller asked for: "embed", "classify", "score" or "encode" (`pooled_output`).
    kind: str


class OutputProcessor:
    """Tracks live requests by engine (child) request id and builds their outputs.

    A failure while detokenizing or checking stops ends only that completion, with
    finish reason "error"; the caller aborts it in the core so its blocks come back.
    """

    def __init__(self, tokenizer, incremental: bool = True, eos_token_ids: frozenset[int] = frozenset()):
        """`incremental=False` when nobody reads an output before it finishes (offline
        generate): the text of a completion without stop strings is then decoded once,
        at its end, instead of every step."""
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.incremental = incremental
        self._live: dict[str, _Completion] = {}

    def add(self, parent: RequestOutput, child_ids: list[str], params: SamplingParams,
            incremental: bool | None = None) -> None:
        """Track every completion of `parent`, or none of them (GenerationError).
        `incremental=False`: nobody reads this request's text before it ends (a "final"
        output), so it is decoded once, at its end, unless it has stop strings to look for;
        None: the processor's own setting."""
        completions = {}
        stop_tokens = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        for index, child_id in enumerate(child_ids):
            output = parent.outputs[index]
            if params.logprobs is not None:
                output.logprobs = []
            try:
                faults.check("detokenize_init", prompt=parent.prompt)
                detok = IncrementalDetokenizer(self.tokenizer, parent.prompt_token_ids, params.stop,
                                               params.skip_special_tokens,
                                               self.incremental if incremental is None else incremental,
                                               params.min_tokens, params.include_stop_str_in_output)
            except Exception as exc:  # noqa: BLE001 - per-request isolation
                raise GenerationError(f"setting up the detokenizer failed: {exc}") from exc
            completions[child_id] = _Completion(parent, output, detok, stop_tokens, frozenset(params.stop_token_ids))
        self._live.update(completions)

    def add_pooled(self, parent: PoolingRequestOutput, kind: str) -> None:
        """Track a pooling request (its id is its engine id: it has one completion)."""
        self._live[parent.request_id] = _Pooled(parent, kind)

    @property
    def num_live(self) -> int:
        return len(self._live)

    def process(self, updates: list[RequestUpdate], step: int | None = None
                ) -> tuple[list[RequestOutput], list[str]]:
        """Apply updates. Returns the outputs that changed and the child ids the core must
        end now (stop string reached, or processing failed).

        If the batch as a whole fails, every request still live in it ends with
        GenerationError, and the requests it already finished keep their final output;
        the engine itself stays healthy."""
        changed: dict[int, RequestOutput] = {}
        to_finish: list[str] = []
        now = time.monotonic()
        try:
            self._process(updates, step, changed, to_finish, now)
        except Exception as exc:  # noqa: BLE001 - isolate the batch, not the engine
            error = GenerationError(f"processing a batch of engine outputs failed: {exc}")
            for update in updates:
                parent = self.fail(update.request_id, error)
                if parent is not None:
                    changed[id(parent)] = parent
                    to_finish.append(update.request_id)
        return list(changed.values()), list(dict.fromkeys(to_finish))

    def _process(self, updates: list[RequestUpdate], step: int | None,
                 changed: dict[int, RequestOutput], to_finish: list[str], now: float) -> None:
        for update in updates:
            live = self._live.get(update.request_id)
            if live is None:
                continue
            if faults.ACTIVE:
                faults.check("output_batch", prompt=live.parent.prompt, step=step)
            if isinstance(live, _Pooled):
                self._pooled(update, live)
                changed[id(live.parent)] = live.parent
                continue
            output = live.output
            output.token_ids.extend(update.new_token_ids)
            metrics = live.parent.metrics
            if metrics is not None and update.new_token_ids:
                if update.token_times is not None:  # (a final-only request's, noted by the core)
                    _add_arrivals(metrics.token_arrivals, update.token_times)
                else:
                    metrics.token_arrivals.append((now, len(update.new_token_ids)))
            if update.new_logprobs is not None and output.logprobs is not None:
                output.logprobs.extend(self._decoded(update.new_logprobs))
            if update.prompt_logprobs is not None and live.parent.prompt_logprobs is None:
                live.parent.prompt_logprobs = [None, *self._decoded(update.prompt_logprobs)]
            changed[id(live.parent)] = live.parent
            detok = live.detokenizer
            if detok.held is not None and update.finish_reason is None and not faults.ACTIVE:
                detok.held.extend(update.new_token_ids)  # its text is decoded at its end
                continue
            try:
                if faults.ACTIVE:
                    faults.check("detokenize", prompt=live.parent.prompt)
                text_ids = update.new_token_ids
                if update.finish_reason == "stop" and text_ids and text_ids[-1] in live.stop_tokens:
                    text_ids = text_ids[:-1]  # the token that ended it has no text in the output
                stopped = detok.add_tokens(text_ids)
                finish_reason = "stop" if stopped else update.finish_reason
                if detok.held is None or finish_reason is not None:  # else the text waits for the end
                    output.text = detok.text
                    output.delta_text = detok.take_delta(finish_reason is not None)
            except Exception as exc:  # noqa: BLE001 - per-request isolation
                self.fail(update.request_id, GenerationError(f"detokenizing failed: {exc}"))
                to_finish.append(update.request_id)
                continue
            if stopped and update.finish_reason is None:
                to_finish.append(update.request_id)
            if finish_reason is not None:
                output.finish_reason = finish_reason
                if finish_reason == "error":
                    output.error = update.error
                _ended(output, live, stopped)
                del self._live[update.request_id]

    def _pooled(self, update: RequestUpdate, live: _Pooled) -> None:
        parent = live.parent
        if update.finish_reason is None:
            return
        del self._live[update.request_id]
        parent.finish_reason = update.finish_reason
        if update.finish_reason == "error":
            parent.error = update.error
        elif update.pooled is not None:
            parent.outputs = pooled_output(live.kind, update.pooled)
        if parent.metrics is not None:
            parent.metrics.token_arrivals.append((time.monotonic(), 0))

    def _decoded(self, entries: list[dict[int, Logprob]]) -> list[dict[int, Logprob]]:
        """The entries with each token's text, decoded alone, as vLLM's `decoded_token`."""
        for entry in entries:
            for token_id, logprob in entry.items():
                logprob.decoded_token = self.tokenizer.decode([token_id])
        return entries

    def fail(self, request_id: str, exc: BaseException) -> RequestOutput | None:
        """End one completion with an error (finish reason "error")."""
        live = self._live.pop(request_id, None)
        if live is None:
            return None
        if isinstance(live, _Pooled):
            live.parent.finish_reason, live.parent.error = "error", error_string(exc)
            return live.parent
        live.output.finish_reason = "error"
        live.output.error = error_string(exc)
        live.output.delta_text = ""
        return live.parent

    def finish(self, request_id: str, reason: str) -> RequestOutput | None:
        """End one completion early (abort) with the text it has."""
        live = self._live.pop(request_id, None)
        if live is None:
            return None
        if isinstance(live, _Pooled):
            live.parent.finish_reason = reason
            return live.parent
        live.output.finish_reason = reason
        try:
            live.output.text = live.detokenizer.text
            live.output.delta_text = live.detokenizer.take_delta(True)
        except Exception:  # noqa: BLE001 - it ends either way, with the text it had
            live.output.delta_text = ""
        return live.parent


def _add_arrivals(arrivals: list[tuple[float, int]], times: list[float]) -> None:
    """Add a token at each of `times` (one completion's, from the core) to `arrivals`,
    kept as the steps would have brought them: in time order, one entry per time with
    the tokens of every completion (n > 1) that became known then."""
    if not arrivals:
        arrivals.extend((at, 1) for at in times)
        return
    merged = dict(arrivals)
    for at in times:
        merged[at] = merged.get(at, 0) + 1
    arrivals[:] = sorted(merged.items())


def _ended(output: CompletionOutput, live: _Completion, stopped: bool) -> None:
    """vLLM's stop_reason (the stop string or stop_token_ids entry that ended it; None for
    EOS, a length limit or a complete grammar) and cumulative_logprob (with logprobs)."""
    if output.finish_reason == "stop":
        if stopped:
            output.stop_reason = live.detokenizer.stop_string
        elif output.token_ids and output.token_ids[-1] in live.stop_token_ids:
            output.stop_reason = output.token_ids[-1]
    if output.logprobs is not None:
        output.cumulative_logprob = sum(entry[t].logprob for t, entry in zip(output.token_ids, output.logprobs))
