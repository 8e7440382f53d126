"""GrammarMasks: structured output in the sampler. The tokens a constrained row's grammar
does not allow get -inf before sampling; rows without a constraint are untouched.

A mask can cost a walk of the grammar over the whole vocabulary (~1 ms for 262k tokens
inside a JSON string), so it is filled once per grammar state (same constraint, same
tokens: every row of a job at its first token). On CUDA the masks are filled on the host
while the device runs the forward (queued, not waited for), then go up in one copy. On a
CPU, where the forward has already run, two shortcuts skip most masks (`argmax_first`):
- a step whose rows are all greedy first asks each grammar whether it allows its row's
  argmax: only rows whose grammar refuses it need a mask. Inside a JSON string, where a
  mask costs most, the model's choice is nearly always allowed; where it is refused
  (punctuation), masks are cheap;
- sampled rows without top-k / top-p / min-p or logprobs are sampled unmasked, and only a token the
  grammar refuses is drawn again from the masked row (`resample_refused`)."""

from __future__ import annotations

from collections import Counter

import torch

from gristmill.model.cpu import kernels
from gristmill.model.sampler import PendingSample, Sampler, SamplerRow, greedy_tokens
from gristmill.outputs import Logprob
from gristmill.step import ScheduledRequest
from gristmill.structured.grammars import fill_masks, torch_bitmask


class GrammarMasks:
    def __init__(self, device: torch.device, sampler: Sampler):
        self.device = device
        self.sampler = sampler
        #: [steps with a constrained row, rows that needed a mask, masks filled].
        self.stats = [0, 0, 0]
        #: Ask the grammar about the model's choice before filling a mask (on a CPU; on
        #: CUDA the masks are filled while the forward runs).
        self.argmax_first = device.type == "cpu"

    def mask(self, logits: torch.Tensor, constrained: list, rows: list[SamplerRow],
             greedy: torch.Tensor | None) -> tuple[list, torch.Tensor | None]:
        """Mask the constrained rows of `logits` ((row, ScheduledRequest) pairs) in place.
        `greedy`: the forward's argmax of `logits`, when it came with them. Returns (the
        sampled rows left unmasked, for `resample_refused`; the argmax of the masked
        logits when every row is greedy, else None)."""
        argmax, deferred = None, []
        if self.argmax_first and all(row.params.greedy for row in rows):
            argmax = (greedy if greedy is not None else greedy_tokens(logits)).clone()
            ids = argmax.tolist()  # (logprobs come from masked logits: rows that want them are masked)
            constrained = [(j, item) for j, item in constrained
                           if rows[j].params.logprobs is not None or not item.matcher.allows(ids[j])]
        elif self.argmax_first:  # (per row, so a seeded row draws the same whatever else is in the step)
            deferred = [(j, item) for j, item in constrained if _unfiltered(rows[j].params)]
            constrained = [(j, item) for j, item in constrained if not _unfiltered(rows[j].params)]
        self.stats[0] += 1
        self.stats[1] += len(constrained)
        if constrained:
            self._apply(logits, constrained)
            if argmax is not None:
                for j, _ in constrained:
                    argmax[j] = greedy_tokens(logits[j:j + 1])[0]
        return deferred, argmax

    def resample_refused(self, logits: torch.Tensor, deferred: list, rows: list[SamplerRow],
                         tokens: torch.Tensor, pending):
        """Sampled constrained rows without top-k / top-p / min-p / logprobs, sampled unmasked: a
        token the grammar refuses is drawn again from the masked row. Exact: token t
        comes first with probability p(t) and after a refusal with (1 - Z) p(t) / Z, in
        all p(t) / Z, Z the mass the grammar allows, which is the masked distribution."""
        ids = tokens.tolist()
        refused = [(j, item) for j, item in deferred if not item.matcher.allows(ids[j])]
        self.stats[1] += len(refused)
        if not refused:
            return tokens, pending
        self._apply(logits, refused)
        index = torch.tensor([j for j, _ in refused])
        again, _ = self.sampler.sample(logits[index], [rows[j] for j, _ in refused])
        tokens = tokens.clone()
        tokens[index] = again
        return tokens, _Redrawn(tokens, pending)

    def _apply(self, logits: torch.Tensor, constrained: list) -> None:
        """Fill the masks of (row, ScheduledRequest) pairs, once per grammar state, and
        apply them."""
        which, matchers = _grammar_states([item for _, item in constrained])
        bitmask = torch_bitmask(len(matchers), logits.shape[-1], pin_memory=self.device.type == "cuda")
        fill_masks(matchers, bitmask)
        self.stats[2] += len(matchers)
        if len(matchers) < len(which):
            bitmask = bitmask[torch.tensor(which)]
        apply_masks(logits, bitmask, [j for j, _ in constrained])


def apply_masks(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set to -inf, in place, the logits of the tokens each row's bitmask does not allow:
    `bitmask[k]` is the mask of `logits[rows[k]]` (bitmask on the host)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
        ops = kernels.fused_ops()
        if ops is not None:  # one pass over the mask words, skipping all-allowed ones
            ops.mask_logits(logits, bitmask, rows)
            return
    allowed = allowed_tokens(bitmask.to(logits.device, non_blocking=True), logits.shape[-1])
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(rows, words) int32 bitmask -> (rows, vocab_size) bool, on the bitmask's device."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1  # (rows, words, 32)
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


class _Redrawn:
    """A step's sample with some rows drawn again (`resample_refused`): their new tokens,
    every other row's logprobs as sampled (a row drawn again asked for none)."""

    def __init__(self, tokens: torch.Tensor, first: PendingSample):
        self.tokens, self.first = tokens, first

    def result(self) -> tuple[list[int], list[dict[int, Logprob] | None]]:
        return self.tokens.tolist(), self.first.result()[1]


def _grammar_states(items: list[ScheduledRequest]) -> tuple[list[int], list]:
    """The distinct grammar states of constrained rows, one mask each: (each row's state,
    a matcher in each state). Rows share a state when they have one constraint and the
    same output so far (every row of a job at its first token). A row's output is copied
    to compare it only when another row has its constraint and output length."""
    keys = [(item.matcher.constraint, item.num_output_tokens) for item in items]
    shared = Counter(keys)
    states: dict[tuple, int] = {}
    which, matchers = [], []
    for key, item in zip(keys, items):
        state = key if shared[key] == 1 else (key, tuple(item.token_ids[item.num_prompt_tokens:]))
        if state not in states:
            states[state] = len(matchers)
            matchers.append(item.matcher)
        which.append(states[state])
    return which, matchers


def _unfiltered(params) -> bool:
    """Sampled from the whole distribution: no top-k, top-p or min-p (which would filter
    the unmasked and the masked logits differently), and no logprobs (which come from
    the masked logits)."""
    return (not params.greedy and params.top_k in (0, -1) and params.top_p == 1.0 and params.min_p == 0.0
            and params.logprobs is None)
