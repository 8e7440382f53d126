"""Sampler: logits of the rows to sample -> token ids (and top-k logprobs with ranks).

A row is sampled by inverting its distribution's cumulative sum at one uniform draw,
taken from the request's own generator when it has a seed, so a seeded request samples
the same tokens whatever else is in the batch. One draw a row, not one per vocabulary
entry (an exponential race over Gemma 3's 262k tokens cost 3-12x the whole sampler on a
CPU). On a CPU a top-k or top-p row is drawn from its most likely tokens only
(`_from_candidates`): sorting a 262k vocabulary took 20 ms a row there, more than the
model's step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gristmill.outputs import Logprob
from gristmill.sampling import SamplingParams

#: How many of its most likely tokens a top-k / top-p row is drawn from on a CPU (and its
#: top_k more); a row whose nucleus reaches past them tries 8x as many, then takes the
#: whole vocabulary's path.
CANDIDATES = 1024


def greedy_tokens(logits: torch.Tensor, pieces: int = 64) -> torch.Tensor:
    """argmax over the last dimension of (rows, vocab) logits, the first index on ties (a
    NaN counting as the largest, as argmax has it): the largest value of each of `pieces`
    slices (`amax`, vectorized over every core), the first slice holding the row's largest,
    then the argmax within that slice alone. On a CPU torch's `argmax` and `max(dim)`
    read a 262k vocabulary at ~2.4 GB/s (28 ms for 64 rows, a tenth of the 270M's step);
    `amax` takes 5."""
    rows, vocab = logits.shape
    if logits.device.type != "cpu" or vocab % pieces or vocab < 4096:
        return logits.argmax(dim=-1)
    sliced = logits.view(rows, pieces, vocab // pieces)
    best = sliced.amax(dim=-1).argmax(dim=-1)
    within = sliced[torch.arange(rows), best].argmax(dim=-1)
    return best * (vocab // pieces) + within


@dataclass
class SamplerRow:
    params: SamplingParams
    generator: torch.Generator | None  # None: the engine's generator


class Sampler:
    #: Pinned host buffers the sampled values are copied into, used in turn: a step's
    #: values are read before the step three launches later writes its own.
    RING = 3

    def __init__(self, seed: int, device: torch.device):
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self._ring: dict[torch.dtype, list[torch.Tensor | None]] = {}
        self._turn = 0

    def _host_buffer(self, values: torch.Tensor) -> torch.Tensor | None:
        """A pinned host buffer for `values` (None on CPU), from the ring."""
        if values.device.type != "cuda":
            return None
        ring = self._ring.setdefault(values.dtype, [None] * self.RING)
        self._turn = (self._turn + 1) % self.RING
        buffer = ring[self._turn]
        if buffer is None or buffer.numel() < values.numel():
            buffer = ring[self._turn] = torch.empty(max(values.numel(), 1024), dtype=values.dtype,
                                                    pin_memory=True)
        return buffer[:values.numel()].view(values.shape)

    def __call__(self, logits: torch.Tensor, rows: list[SamplerRow], argmax: torch.Tensor | None = None):
        """logits: (num_rows, vocab); argmax: their argmax when the forward computed it.
        Returns (token ids list, per row {token id: Logprob} or None)."""
        return self.sample(logits, rows, argmax)[1].result()

    def sample(self, logits: torch.Tensor, rows: list[SamplerRow],
               argmax: torch.Tensor | None = None) -> tuple[torch.Tensor, "PendingSample"]:
        """The sampled ids on the device, and the same ids with the logprobs asked for on
        their way to the host, in one copy that does not wait for the device."""
        greedy = [i for i, row in enumerate(rows) if row.params.greedy]
        random = [i for i, row in enumerate(rows) if not row.params.greedy]
        if not random:  # all greedy: argmax of the logits as they are (exact in any float dtype)
            tokens = argmax if argmax is not None else greedy_tokens(logits)
        else:
            logits = logits.float()
            tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
            if greedy:
                index = torch.tensor(greedy, device=logits.device)
                tokens[index] = greedy_tokens(logits[index])
            index = torch.tensor(random, device=logits.device)
            draws = self._draws([rows[i].generator for i in random], logits.device)
            tokens[index] = self._draw_tokens(logits[index], [rows[i].params for i in random], draws)
        wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        if not wanted:
            return tokens, PendingSample(tokens, self._host_buffer(tokens), _no_logprobs)
        return tokens, self._with_logprobs(logits, rows, tokens, wanted)

    def sample_greedy(self, logits: torch.Tensor, argmax: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, "PendingSample"]:
        """`sample` for rows that are all greedy and want no logprobs."""
        tokens = argmax if argmax is not None else greedy_tokens(logits)
        return tokens, PendingSample(tokens, self._host_buffer(tokens), _no_logprobs)

    def _draws(self, generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
        """(rows, 1) uniform draws in [0, 1): from a row's own generator (a seeded
        request), else all at once from the engine's."""
        draws = torch.empty(len(generators), 1, device=device)
        shared = [i for i, g in enumerate(generators) if g is None]
        if shared:
            draws[torch.tensor(shared, device=device)] = torch.rand(len(shared), 1, device=device,
                                                                    generator=self.generator)
        for i, generator in enumerate(generators):
            if generator is not None:
                draws[i] = torch.rand(1, device=device, generator=generator)
        return draws

    def _draw_tokens(self, logits: torch.Tensor, params: list[SamplingParams], draws: torch.Tensor) -> torch.Tensor:
        """A token per row of (rows, vocab) float logits, drawn at its uniform draw from
        its distribution after temperature, top_k, top_p and min_p."""
        narrow = ([j for j, p in enumerate(params) if p.top_k > 0 or p.top_p < 1.0]
                  if logits.device.type == "cpu" else [])  # (on CUDA it would wait for the device)
        if not narrow:
            return _inverse_cdf(self._filtered_probs(logits, params), draws, logits)
        tokens = torch.empty(len(params), dtype=torch.long)
        chosen, left, vocab = set(narrow), narrow, logits.shape[-1]
        for count in (CANDIDATES, 8 * CANDIDATES):  # (a flat distribution, a high temperature: more)
            # Rows grouped by how many candidates each takes, a number of its own: how
            # `topk` orders tied logits depends on it, so it must not depend on other rows.
            groups: dict[int, list[int]] = {}
            for j in left:
                top_k = params[j].top_k if 0 < params[j].top_k < vocab else 0
                groups.setdefault(min(vocab, top_k + count), []).append(j)
            left = []
            for width, group in groups.items():
                picked, wide = _from_candidates(logits[group], [params[j] for j in group], draws[group], width)
                tokens[group] = picked
                left += [group[w] for w in wide]
            if not left:
                break
        whole = sorted([j for j in range(len(params)) if j not in chosen] + left)
        if whole:
            tokens[whole] = _inverse_cdf(self._filtered_probs(logits[whole], [params[j] for j in whole]),
                                         draws[whole], logits[whole])
        return tokens

    def _filtered_probs(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        device = logits.device
        temps = torch.tensor([p.temperature for p in params], device=device)[:, None]
        logits = logits / temps
        top_ks = [p.top_k for p in params]
        if any(k > 0 for k in top_ks):
            vocab = logits.shape[-1]
            ks = torch.tensor([min(k, vocab) if k > 0 else vocab for k in top_ks], device=device)
            kth = logits.sort(dim=-1, descending=True).values.gather(1, (ks - 1).clamp(max=vocab - 1)[:, None])
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = logits.softmax(dim=-1)
        top_ps = [p.top_p for p in params]
        if any(p < 1.0 for p in top_ps):
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            # Drop a token when the tokens ranked above it already reach top_p.
            before = sorted_probs.cumsum(dim=-1) - sorted_probs
            drop = before >= torch.tensor(top_ps, device=device)[:, None]
            drop[:, 0] = False  # the most likely token stays, however small top_p is
            probs = probs.scatter(1, order, sorted_probs.masked_fill(drop, 0.0))
        min_ps = [p.min_p for p in params]
        if any(p > 0 for p in min_ps):
            floor = probs.max(dim=-1, keepdim=True).values * torch.tensor(min_ps, device=device)[:, None]
            probs = probs.masked_fill(probs < floor, 0.0)
        return probs

    def _with_logprobs(self, logits: torch.Tensor, rows: list[SamplerRow], tokens: torch.Tensor,
                       wanted: list[int]) -> "PendingSample":
        """Token ids, and for the rows in `wanted` the Logprobs of the sampled token and
        the top-k: computed on the device, copied to the host with the ids, in one copy.
        The sampled token's rank is 1 + the number of tokens more likely than it."""
        index = torch.tensor(wanted, device=logits.device)
        logprobs = logits[index].float().log_softmax(dim=-1)
        k = max(max(rows[i].params.logprobs for i in wanted), 1)
        top_values, top_ids = logprobs.topk(k, dim=-1)
        chosen = logprobs.gather(1, tokens[index][:, None])
        ranks = (logprobs > chosen).sum(dim=-1) + 1
        # float64 holds every token id and rank exactly
        packed = torch.cat([tokens.double(), chosen[:, 0].double(), ranks.double(), top_values.double().flatten(),
                            top_ids.double().flatten()])
        return PendingSample(packed, self._host_buffer(packed), lambda values: _unpack_logprobs(values, rows, wanted, k))


def _inverse_cdf(probs: torch.Tensor, draws: torch.Tensor, logits: torch.Tensor,
                 ids: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of `probs` (rows, n), drawn with its probability: the first
    column whose cumulative sum passes draw * total. `ids`: the token id of each column
    (None: column j is token j). A row whose probabilities are not a distribution (an
    overflow made them NaN, or nothing is left) takes the argmax of its `logits` (rows,
    vocab): never an id outside the vocabulary."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    # Strictly below the total, so the token found has a probability above zero
    # (the cumulative sum rises there) even when u * total rounds up to the total.
    target = torch.minimum(draws * total, torch.nextafter(total, torch.zeros_like(total)))
    column = torch.searchsorted(cdf, target, right=True).clamp(max=probs.shape[-1] - 1)
    tokens = (column if ids is None else ids.gather(1, column))[:, 0]
    broken = ~(total[:, 0] > 0) | ~torch.isfinite(total[:, 0])
    if probs.device.type == "cpu" and not bool(broken.any()):
        return tokens  # (on CUDA a select on the device instead: no sync)
    return torch.where(broken, greedy_tokens(logits.nan_to_num(nan=float("-inf"))), tokens)


def _from_candidates(logits: torch.Tensor, params: list[SamplingParams], draws: torch.Tensor,
                     width: int) -> tuple[torch.Tensor, list[int]]:
    """Tokens of top-k / top-p rows of (rows, vocab) float logits, drawn from their
    `width` (> any top_k of theirs) most likely tokens as `Sampler._filtered_probs` and the inverse
    CDF over the whole vocabulary would draw them: the same tokens kept (all of them
    are among the candidates), the same cumulative sums in token-id order, the same
    draw. Also the rows whose nucleus reaches past the candidates: their tokens are
    left for the whole vocabulary's path."""
    rows, vocab = logits.shape
    ks = torch.tensor([p.top_k if 0 < p.top_k < vocab else 0 for p in params])
    values, ids = logits.topk(width, dim=-1)  # most likely first
    temps = torch.tensor([p.temperature for p in params])[:, None]
    scaled = values / temps
    limited = ks > 0
    probs = torch.empty_like(scaled)
    if bool(limited.any()):  # top_k: every token at least as likely as the k-th stays
        kth = scaled[limited].gather(1, (ks[limited] - 1)[:, None])
        probs[limited] = scaled[limited].masked_fill(scaled[limited] < kth, float("-inf")).softmax(dim=-1)
    if not bool(limited.all()):  # else the probabilities of the whole vocabulary, as that path has them
        whole = ~limited
        probs[whole] = (logits[whole] / temps[whole]).softmax(dim=-1).gather(1, ids[whole])
    top_ps = torch.tensor([p.top_p for p in params])[:, None]
    running = probs.cumsum(dim=-1)
    # A token ranked after the nucleus is dropped; the most likely stays.
    drop = running - probs >= top_ps
    drop[:, 0] = False
    wide = (~limited & (running[:, -1] < top_ps[:, 0])).nonzero()[:, 0].tolist()
    probs = probs.masked_fill(drop, 0.0)
    min_ps = torch.tensor([p.min_p for p in params])[:, None]
    if bool((min_ps > 0).any()):
        probs = probs.masked_fill(probs < probs[:, :1] * min_ps, 0.0)
    order = ids.argsort(dim=-1)
    return _inverse_cdf(probs.gather(1, order), draws, logits, ids.gather(1, order)), wide


class PendingSample:
    """A step's sampled values on their way to the host: the copy is queued behind the
    step on the device (into pinned memory, so it does not block), and `result()` waits
    for it only when the host needs the values."""

    def __init__(self, values: torch.Tensor, host: torch.Tensor | None, unpack):
        """`host`: a pinned buffer shaped like `values` (a CUDA tensor), or None (on CPU)."""
        self.unpack = unpack
        self.event = None
        self.values = values
        if host is not None:
            self.values = host
            host.copy_(values, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def result(self) -> tuple[list[int], list[dict[int, Logprob] | None]]:
        if self.event is not None:
            self.event.synchronize()
        return self.unpack(self.values.tolist())


def _no_logprobs(ids: list[int]) -> tuple[list[int], list[None]]:
    return ids, [None] * len(ids)


def _unpack_logprobs(packed: list[float], rows: list[SamplerRow], wanted: list[int], k: int):
    n, m = len(rows), len(wanted)
    token_list = [int(t) for t in packed[:n]]
    chosen_list, ranks = packed[n:n + m], packed[n + m:n + 2 * m]
    values, ids = packed[n + 2 * m:n + 2 * m + m * k], packed[n + 2 * m + m * k:]
    result: list[dict[int, Logprob] | None] = [None] * n
    for row, i in enumerate(wanted):
        entry = {token_list[i]: Logprob(chosen_list[row], int(ranks[row]))}
        for place, j in enumerate(range(row * k, row * k + rows[i].params.logprobs), 1):
            if int(ids[j]) not in entry:
                entry[int(ids[j])] = Logprob(values[j], place)
        result[i] = entry
    return token_list, result
