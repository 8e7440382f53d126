"""The two grammar engines gristmill could use for structured output, side by side on the
bundled model's real tokenizer (Gemma 3, 262k tokens), in one run:

- llguidance (1.9.x) and xgrammar (0.2.x), each from its wheel;
- tokenizer set-up time (once per model), compile time of a nested JSON schema (cold),
  and the time to compute the token masks of a batch of 64 requests at each step while
  they generate a valid document under that schema (the per-step cost the sampler waits
  for), single-threaded and with each engine's batch API.

    pip install llguidance xgrammar
    python benchmarks/structured_backends.py [--batch 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from gristmill.engine.builder import load_tokenizer
from gristmill.model.loader import resolve_model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {"type": "object", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"},
            "geo": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                    "required": ["lat", "lon"]}},
            "required": ["street", "city", "geo"]},
        "status": {"enum": ["active", "inactive", "banned"]},
        "orders": {"type": "array", "items": {"type": "object", "properties": {
            "id": {"type": "integer"}, "total": {"type": "number"},
            "items": {"type": "array", "items": {"type": "object", "properties": {
                "sku": {"type": "string"}, "qty": {"type": "integer"}}, "required": ["sku", "qty"]}}},
            "required": ["id", "total", "items"]}},
    },
    "required": ["name", "age", "email", "tags", "address", "status", "orders"],
    "additionalProperties": False,
}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "email": "ada@engine.org", "tags": ["math", "poetry"],
            "address": {"street": "12 St James's Square", "city": "London", "geo": {"lat": 51.5, "lon": -0.13}},
            "status": "active",
            "orders": [{"id": 1, "total": 12.5, "items": [{"sku": "A-1", "qty": 2}, {"sku": "B-7", "qty": 1}]}]}


def bench_llguidance(tokenizer, eos, tokens, batch):
    import llguidance
    import llguidance.hf
    import llguidance.torch

    start = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer, eos_token=eos)
    setup = time.perf_counter() - start
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(batch)]
    assert not matchers[0].is_error(), matchers[0].get_error()
    compile_s = time.perf_counter() - start
    mask = llguidance.torch.allocate_token_bitmask(batch, lltok.vocab_size)
    executor = llguidance.LLExecutor()
    single, parallel = [], []
    for token in tokens:
        start = time.perf_counter()
        for i, m in enumerate(matchers):
            llguidance.torch.fill_next_token_bitmask(m, mask, i)
        single.append(time.perf_counter() - start)
        start = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], mask)
        parallel.append(time.perf_counter() - start)
        for m in matchers:
            assert m.consume_token(token), m.get_error()
    assert all(m.is_accepting() for m in matchers)
    return setup, compile_s, single, parallel


def bench_xgrammar(tokenizer, eos, tokens, batch):
    import xgrammar

    start = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, stop_token_ids=[eos])
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    setup = time.perf_counter() - start
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
    matchers = [xgrammar.GrammarMatcher(compiled) for _ in range(batch)]
    compile_s = time.perf_counter() - start
    mask = xgrammar.allocate_token_bitmask(batch, info.vocab_size)
    batch_matcher = xgrammar.BatchGrammarMatcher() if hasattr(xgrammar, "BatchGrammarMatcher") else None
    single, parallel = [], []
    for token in tokens:
        start = time.perf_counter()
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(mask, i)
        single.append(time.perf_counter() - start)
        if batch_matcher is not None:
            start = time.perf_counter()
            batch_matcher.batch_fill_next_token_bitmask(matchers, mask)
            parallel.append(time.perf_counter() - start)
        for m in matchers:
            assert m.accept_token(token), token
    return setup, compile_s, single, parallel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer, eos_ids = load_tokenizer(resolve_model(None))
    eos = min(eos_ids)
    tokens = tokenizer(json.dumps(DOCUMENT, separators=(",", ":")), add_special_tokens=False).input_ids
    print(f"Gemma 3 tokenizer, {len(tokenizer)} tokens; a {len(tokens)}-token document; batch {args.batch}")
    print(f"{'engine':>11} {'setup s':>8} {'compile ms':>11} {'mask ms/step (1 thread)':>24} {'batch API':>10}")
    for name, bench in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
        try:
            setup, compile_s, single, parallel = bench(tokenizer, eos, tokens, args.batch)
        except ImportError as exc:
            print(f"{name:>11}: not installed ({exc})")
            continue
        par = f"{statistics.median(parallel) * 1e3:10.2f}" if parallel else f"{'-':>10}"
        print(f"{name:>11} {setup:8.2f} {compile_s * 1e3:11.1f} {statistics.median(single) * 1e3:24.2f} {par}"
              f"   (p99 1 thread {sorted(single)[int(0.99 * (len(single) - 1))] * 1e3:.2f} ms)")


if __name__ == "__main__":
    main()
