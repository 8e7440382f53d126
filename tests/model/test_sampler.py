"""The sampler draws each token with its probability (inverse CDF, one uniform a row):
frequencies match the softmax, filtered-out tokens never come, and a seeded request
samples the same tokens whatever else is in the batch."""

from __future__ import annotations

import pytest
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


def test_top_k_and_top_p_rows_draw_from_their_candidates_what_the_whole_vocabulary_would_give():
    """On a CPU a top-k / top-p row is drawn from its most likely tokens only; at the same
    draw it gets the token the whole vocabulary's path (softmax, a sort of every token,
    the inverse CDF in token-id order) gives. A row whose nucleus is wider than the
    candidates (a flat distribution) takes that path itself."""
    from gristmill.model.sampler import CANDIDATES, _inverse_cdf

    vocab = 32768
    generator = torch.Generator().manual_seed(3)
    sharp = torch.randn(48, vocab, generator=generator) * 4
    ties = sharp.bfloat16().float()  # bf16 logits: many exact ties
    flat = torch.randn(8, vocab, generator=generator) * 0.1  # the nucleus reaches far past the candidates
    params = [SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=1.3, top_p=0.95, min_p=0.01),
              SamplingParams(temperature=0.7, top_k=40), SamplingParams(temperature=1.0, top_k=2000, top_p=0.8),
              SamplingParams(temperature=1.1), SamplingParams(temperature=0.9, top_p=0.5, top_k=5)]
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    for logits in (sharp, ties, flat):
        rows = [params[i % len(params)] for i in range(len(logits))]
        draws = torch.rand(len(logits), 1, generator=generator)
        fast = sampler._draw_tokens(logits, rows, draws)
        whole = _inverse_cdf(sampler._filtered_probs(logits, rows), draws, logits)
        # (exact here; a tie at the nucleus' edge may order two tokens otherwise than a sort)
        assert int((fast != whole).sum()) <= 2, (fast != whole).nonzero()
        assert 0 <= int(fast.min()) and int(fast.max()) < vocab
    assert CANDIDATES < vocab  # (else nothing here took the candidates' path)


def test_a_seeded_top_p_row_samples_the_same_tokens_beside_a_top_k_row_with_bf16_logits():
    """`topk` orders tied logits (bf16 gives many) differently at another width, and which
    of two tied tokens at the nucleus' edge is kept moves the token drawn: a row's
    candidates are counted from its own top_k, never from the other rows' (the batch's
    largest top_k + 1,024 changed ~3% of this row's tokens beside a top_k=50 row)."""
    vocab = 32768
    source = torch.Generator().manual_seed(1)
    steps = [(torch.randn(1, vocab, generator=source) * 3).bfloat16().float() for _ in range(200)]
    others = torch.randn(1, vocab, generator=source) * 3
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=42)

    def run(other: SamplingParams | None) -> list[int]:
        sampler = Sampler(seed=7, device=torch.device("cpu"))
        generator = torch.Generator().manual_seed(42)
        tokens = []
        for logits in steps:
            rows = [SamplerRow(seeded, generator)]
            if other is not None:
                logits = torch.cat([logits, others])
                rows.append(SamplerRow(other, None))
            tokens.append(sampler(logits, rows)[0][0])
        return tokens

    alone = run(None)
    assert run(SamplingParams(temperature=1.0, top_p=0.9)) == alone  # (same width: passes)
    beside_top_k = run(SamplingParams(temperature=1.0, top_k=50))
    assert beside_top_k == alone, [i for i, (a, b) in enumerate(zip(alone, beside_top_k)) if a != b]


def test_logprobs_rank_the_sampled_token_where_it_stands_in_the_whole_distribution():
    """A row that asks for logprobs gets Logprobs (vLLM's): the top-k with ranks 1..k, and
    the sampled token with its true rank, 1 + the tokens more likely than it, also when
    it is far outside the top-k. A row that asks for none gets None."""
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    rows = [SamplerRow(SamplingParams(temperature=3.0, logprobs=1), None)] * 400
    rows.append(SamplerRow(SamplingParams(temperature=3.0), None))
    tokens, logprobs = sampler(LOGITS.expand(len(rows), -1).contiguous(), rows)
    assert logprobs[-1] is None
    expected = LOGITS.log_softmax(-1)
    for token, entry in zip(tokens[:-1], logprobs[:-1]):
        assert entry[0].rank == 1 and entry[0].logprob == pytest.approx(expected[0].item())
        assert entry[token].rank == 1 + int((LOGITS > LOGITS[token]).sum())
        assert entry[token].logprob == pytest.approx(expected[token].item())
    assert {entry[t].rank for t, entry in zip(tokens, logprobs[:-1])} >= {1, 2, 3, 4, 5, 6}
