"""The sampler draws each token with its probability (inverse CDF, one uniform a row):
frequencies match the softmax, filtered-out tokens never come, and a seeded request
samples the same tokens whatever else is in the batch."""

from __future__ import annotations

import torch

from gristmill.model.sampler import Sampler, SamplerRow
from gristmill.sampling import SamplingParams

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -30.0, 1.5, 0.25])


def _draw(sampler, params: SamplingParams, rows: int, logits=LOGITS, generator=None) -> list[int]:
    batch = logits.expand(rows, -1).contiguous()
    tokens, _ = sampler(batch, [SamplerRow(params, generator)] * rows)
    return tokens


def test_frequencies_follow_the_tempered_softmax():
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    params = SamplingParams(temperature=0.7)
    counts = torch.zeros(len(LOGITS))
    for _ in range(20):
        counts += torch.bincount(torch.tensor(_draw(sampler, params, 2000)), minlength=len(LOGITS))
    n = counts.sum()
    expected = (LOGITS / 0.7).softmax(-1) * n
    sigma = (expected * (1 - expected / n)).sqrt()
    assert ((counts - expected).abs() <= 5 * sigma + 1).all(), (counts, expected)
    assert counts[5] == 0  # p ~ 1e-19


def test_filtered_tokens_never_come():
    sampler = Sampler(seed=1, device=torch.device("cpu"))
    assert set(_draw(sampler, SamplingParams(temperature=1.0, top_k=2), 4000)) == {0, 6}
    assert set(_draw(sampler, SamplingParams(temperature=1.0, top_p=0.5), 4000)) <= {0, 6, 1}
    only = torch.full((len(LOGITS),), float("-inf"))
    only[-1] = 0.0  # all the mass on the last token: a draw near 1 still lands on it
    assert set(_draw(sampler, SamplingParams(temperature=1.0), 4000, only)) == {len(LOGITS) - 1}


def test_a_seeded_row_samples_the_same_tokens_whatever_the_batch():
    params = SamplingParams(temperature=1.0, seed=42)
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0))

    def run(batch_rows: int) -> list[int]:
        sampler = Sampler(seed=7, device=torch.device("cpu"))
        generator = torch.Generator().manual_seed(42)
        tokens = []
        for step in range(30):
            batch = torch.cat([logits[step % 3:step % 3 + 1], logits.repeat(batch_rows, 1)[:batch_rows]])
            rows = [SamplerRow(params, generator)] + [SamplerRow(SamplingParams(temperature=0.9), None)] * batch_rows
            tokens.append(sampler(batch, rows)[0][0])
        return tokens

    alone = run(0)
    assert run(5) == alone == run(2)
    assert len(set(alone)) > 5  # it does sample
