"""Sampler: logits of the rows to sample -> token ids (and top-k logprobs).

Randomness comes from exponential races (argmax of probs / Exp(1) noise), drawn per row
from the request's own generator when it has a seed, so a seeded request samples the
same tokens whatever else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gristmill.sampling import SamplingParams


def greedy_tokens(logits: torch.Tensor, pieces: int = 64) -> torch.Tensor:
    """argmax over the last dimension of (rows, vocab) logits, the first index on ties, in
    two passes (the max of each of `pieces` slices, then the best slice): 2-4x faster than
    one `argmax` over a 262k vocabulary on CPU, which reduces each row on one thread."""
    rows, vocab = logits.shape
    if logits.device.type != "cpu" or vocab % pieces or vocab < 4096:
        return logits.argmax(dim=-1)
    values, within = logits.view(rows, pieces, vocab // pieces).max(dim=-1)
    best = values.argmax(dim=-1)
    return best * (vocab // pieces) + within.gather(1, best[:, None])[:, 0]


@dataclass
class SamplerRow:
    params: SamplingParams
    generator: torch.Generator | None  # None: the engine's generator


class Sampler:
    def __init__(self, seed: int, device: torch.device):
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SamplerRow], argmax: torch.Tensor | None = None):
        """logits: (num_rows, vocab); argmax: their argmax when the forward computed it.
        Returns (token ids list, logprobs list of dict|None). One device-to-host copy of
        the sampled ids (and one of the logprobs asked for)."""
        greedy = [i for i, row in enumerate(rows) if row.params.greedy]
        random = [i for i, row in enumerate(rows) if not row.params.greedy]
        if not random:  # all greedy: argmax of the logits as they are (exact in any float dtype)
            tokens = (argmax if argmax is not None else greedy_tokens(logits)).tolist()
            return tokens, self._logprobs(logits, rows, tokens)
        logits = logits.float()
        tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        if greedy:
            index = torch.tensor(greedy, device=logits.device)
            tokens[index] = greedy_tokens(logits[index])
        if random:
            index = torch.tensor(random, device=logits.device)
            probs = self._filtered_probs(logits[index], [rows[i].params for i in random])
            noise = self._exponential_noise(probs, [rows[i].generator for i in random])
            tokens[index] = (probs / noise).argmax(dim=-1)
        token_list = tokens.tolist()
        return token_list, self._logprobs(logits, rows, token_list)

    def _filtered_probs(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        device = logits.device
        temps = torch.tensor([p.temperature for p in params], device=device)[:, None]
        logits = logits / temps
        top_ks = [p.top_k for p in params]
        if any(k > 0 for k in top_ks):
            vocab = logits.shape[-1]
            ks = torch.tensor([k if k > 0 else vocab for k in top_ks], device=device)
            kth = logits.sort(dim=-1, descending=True).values.gather(1, (ks - 1).clamp(max=vocab - 1)[:, None])
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = logits.softmax(dim=-1)
        top_ps = [p.top_p for p in params]
        if any(p < 1.0 for p in top_ps):
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            # Drop a token when the tokens ranked above it already reach top_p.
            before = sorted_probs.cumsum(dim=-1) - sorted_probs
            drop = before >= torch.tensor(top_ps, device=device)[:, None]
            probs = probs.scatter(1, order, sorted_probs.masked_fill(drop, 0.0))
        min_ps = [p.min_p for p in params]
        if any(p > 0 for p in min_ps):
            floor = probs.max(dim=-1, keepdim=True).values * torch.tensor(min_ps, device=device)[:, None]
            probs = probs.masked_fill(probs < floor, 0.0)
        return probs

    def _exponential_noise(self, probs: torch.Tensor, generators) -> torch.Tensor:
        noise = torch.empty_like(probs)
        shared = [i for i, g in enumerate(generators) if g is None]
        if shared:
            index = torch.tensor(shared, device=probs.device)
            noise[index] = torch.empty(len(shared), probs.shape[1], device=probs.device).exponential_(
                generator=self.generator)
        for i, generator in enumerate(generators):
            if generator is not None:
                noise[i].exponential_(generator=generator)
        return noise.clamp_(min=1e-30)  # a zero draw would turn 0 / 0 into NaN

    @staticmethod
    def _logprobs(logits: torch.Tensor, rows: list[SamplerRow], tokens: list[int]):
        wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        result: list[dict[int, float] | None] = [None] * len(rows)
        if not wanted:
            return result
        index = torch.tensor(wanted, device=logits.device)
        logprobs = logits[index].float().log_softmax(dim=-1)
        k = max(rows[i].params.logprobs for i in wanted)
        top_values, top_ids = logprobs.topk(max(k, 1), dim=-1)
        chosen = logprobs.gather(1, torch.tensor([tokens[i] for i in wanted], device=logits.device)[:, None])
        top_values, top_ids, chosen = top_values.tolist(), top_ids.tolist(), chosen[:, 0].tolist()
        for row, i in enumerate(wanted):
            num = rows[i].params.logprobs
            entry = {tokens[i]: chosen[row]}
            for token_id, value in zip(top_ids[row][:num], top_values[row][:num]):
                entry.setdefault(token_id, value)
            result[i] = entry
        return result
