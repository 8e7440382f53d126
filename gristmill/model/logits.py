"""The logits controls a request may ask for, applied between the LM head and the sampler
to only the rows that ask, a few batched tensor ops each:

1. `logit_bias`: {token: bias} added (one scatter over every biased row);
2. bans: end-of-sequence and stop tokens before `min_tokens`, and `bad_words`;
3. penalties over the tokens so far: OpenAI's presence and frequency penalties
   (completion tokens), vLLM's and transformers' repetition penalty (prompt and
   completion tokens).

The structured-output masks come after them (model/masking.py). Under async
scheduling a request's last token may not be on the host yet (a PLACEHOLDER): its id is
read on the device from the last step's sampled ids (`token_buffer`)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from gristmill.step import ScheduledRequest


class LogitsControls:
    def __init__(self, device: torch.device):
        self.device = device

    def apply(self, logits: torch.Tensor, items: list[ScheduledRequest], token_buffer: torch.Tensor,
              rows: Callable[[], dict[str, int]]) -> bool:
        """Apply every row's controls to `logits` (num_rows, vocab) in place. `items`: the
        ScheduledRequest of each row; `token_buffer[rows()[request_id]]`: the id of a
        request's pending token (`rows` is called only when a penalty needs it). Returns
        whether any row asked for one."""
        controlled = [j for j, item in enumerate(items) if item.controlled]
        if not controlled:  # (most steps: one pass over the rows)
            return False
        params = {j: items[j].sampling_params for j in controlled}
        biased = [j for j in controlled if params[j].logit_bias]
        banned = [j for j in controlled if _bans_something(items[j])]
        penalized = [j for j in controlled if params[j].penalized]
        if biased:
            self._bias(logits, [(j, params[j].logit_bias) for j in biased])
        if banned:
            self._ban(logits, [(j, items[j]) for j in banned])
        if penalized:
            self._penalize(logits, [items[j] for j in penalized], penalized, token_buffer,
                           rows())
        return bool(biased or banned or penalized)

    def _bias(self, logits: torch.Tensor, biased: list) -> None:
        rows, tokens, values = [], [], []
        for j, bias in biased:
            for token, value in bias.items():
                if token < logits.shape[-1]:
                    rows.append(j)
                    tokens.append(token)
                    values.append(value)
        if rows:
            self._put(logits, rows, tokens, torch.tensor(values, dtype=logits.dtype), accumulate=True)

    def _ban(self, logits: torch.Tensor, banned: list) -> None:
        rows, tokens = [], []
        for j, item in banned:
            for token in banned_tokens(item):
                if token < logits.shape[-1]:
                    rows.append(j)
                    tokens.append(token)
        if rows:
            self._put(logits, rows, tokens, torch.tensor(float("-inf"), dtype=logits.dtype))

    def _put(self, logits: torch.Tensor, rows: list[int], tokens: list[int], values: torch.Tensor,
             accumulate: bool = False) -> None:
        index = torch.tensor([rows, tokens], device=self.device)
        logits.index_put_((index[0], index[1]), values.to(self.device), accumulate=accumulate)

    def _penalize(self, logits: torch.Tensor, items: list[ScheduledRequest], rows: list[int],
                  token_buffer: torch.Tensor, pending_rows: dict[str, int]) -> None:
        """Repetition, then presence and frequency penalties (vLLM's order) over rows
        `rows`, in float32. Only the logits of tokens a row has seen are read and written
        (one gather, one scatter), never a (rows, vocab) tensor; every shape is known
        before the step runs, so nothing waits for the device."""
        device, vocab = self.device, logits.shape[-1]
        params = [item.sampling_params for item in items]
        repeats = any(p.repetition_penalty != 1.0 for p in params)
        at, tokens, is_output = self._history(items, token_buffer, pending_rows, with_prompt=repeats)
        # How often each (row, token) pair is a completion token, counted over its run
        # of equal keys in sorted order (a pair seen twice gets the same value twice).
        keys, order = torch.sort(at * vocab + tokens)
        starts = torch.ones_like(keys, dtype=torch.bool)
        starts[1:] = keys[1:] != keys[:-1]
        run = starts.long().cumsum(0) - 1
        counts = torch.zeros(len(keys), device=device).index_add_(0, run, is_output[order].float())[run]
        at, tokens = keys // vocab, keys % vocab
        row = torch.tensor(rows, device=device)[at]
        scores = logits[row, tokens].float()
        if repeats:
            penalty = torch.tensor([p.repetition_penalty for p in params], device=device)[at]
            scores = torch.where(scores > 0, scores / penalty, scores * penalty)
        frequency = torch.tensor([p.frequency_penalty for p in params], device=device)[at]
        presence = torch.tensor([p.presence_penalty for p in params], device=device)[at]
        scores -= frequency * counts + presence * (counts > 0)
        logits[row, tokens] = scores.to(logits.dtype)

    def _history(self, items: list[ScheduledRequest], token_buffer: torch.Tensor, pending_rows: dict[str, int],
                 with_prompt: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(item, token, is a completion token) triples, on the device, of each request's
        tokens (completion only, or prompt too); a pending token's id is taken from
        `token_buffer`."""
        at, tokens, is_output, pending, sources = [], [], [], [], []
        for k, item in enumerate(items):
            start = 0 if with_prompt else item.num_prompt_tokens
            known = np.asarray(item.token_ids[start:len(item.token_ids) - item.pending], dtype=np.int64)
            at.append(np.full(len(known), k, dtype=np.int64))
            tokens.append(known)
            is_output.append(np.arange(start, start + len(known)) >= item.num_prompt_tokens)
            if item.pending:
                pending.append(k)
                sources.append(pending_rows[item.request_id])
        at_t = torch.from_numpy(np.concatenate(at)).to(self.device)
        tokens_t = torch.from_numpy(np.concatenate(tokens)).to(self.device)
        is_output_t = torch.from_numpy(np.concatenate(is_output)).to(self.device)
        if pending:
            at_t = torch.cat([at_t, torch.tensor(pending, device=self.device)])
            tokens_t = torch.cat([tokens_t, token_buffer[torch.tensor(sources, device=self.device)].long()])
            is_output_t = torch.cat([is_output_t, torch.ones(len(pending), dtype=torch.bool, device=self.device)])
        return at_t, tokens_t, is_output_t


def _bans_something(item: ScheduledRequest) -> bool:
    return bool(item.bad_words_ids) or item.num_output_tokens < item.sampling_params.min_tokens


def banned_tokens(item: ScheduledRequest) -> list[int]:
    """The tokens a request may not sample next: its stop tokens (EOS unless ignore_eos,
    stop_token_ids) while it has fewer than min_tokens, and the last token of each bad
    word whose other tokens end its completion so far (its known tokens: a request with
    a bad word of several tokens is never run ahead by async scheduling)."""
    params = item.sampling_params
    num_output = item.num_output_tokens
    banned = []
    if num_output < params.min_tokens:
        if not params.ignore_eos:
            banned.extend(item.eos_token_ids)
        banned.extend(params.stop_token_ids)
    token_ids, end = item.token_ids, len(item.token_ids)
    for word in item.bad_words_ids:
        before = len(word) - 1
        if before == 0 or (num_output >= before and tuple(token_ids[end - before:end]) == word[:-1]):
            banned.append(word[-1])
    return banned
