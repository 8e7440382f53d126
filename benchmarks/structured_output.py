"""What structured output and penalties cost: the same batch (64 rows, 64 greedy tokens,
EOS ignored for the free rows) with every row under a JSON schema, with every row asking
for all three penalties (repetition, presence, frequency), and with neither, side by side
in one run on the bundled model; plus the grammar compile time of that schema, cold (a
new engine) and cached.

Then tool calls: the same number of chats with two tools, under tool_choice "required"
(the grammar writes every call) and under "auto" (the lazy grammar waits for a call to
start; EOS ignored, so it waits all the way), one call a chat at most, each against the same chats' plain
generation (tools rendered, tool_choice "none") of the same number of tokens per row. A
forced call ends on its own, so its plain twin gets each row's own count. A model with no
call syntax of its own in its chat template (the bundled Gemma 3) is read with
`--tool-call-parser` (hermes unless told). The forced calls run again on a second engine
with `fast_forward=False` (every token of a call sampled under the mask; `--no-twin`
skips it), against their own plain twin.

    python benchmarks/structured_output.py [--device cpu|cuda] [--batch 64] [--tokens 64] [--temperature 0]
        [--model PATH] [--only schema|tools] [--tool-call-parser hermes|pythonic|llama3_json] [--no-twin]
"""

from __future__ import annotations

import argparse
import time

from gristmill import LLM, SamplingParams
from gristmill.chat.tool_calls import get_tool_parser
from gristmill.structured.spec import parse_constraint

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "status": {"enum": ["active", "inactive", "banned"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                      "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "status", "age", "tags", "address"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "find_customer", "description": "Look a customer up", "parameters": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                  "maxItems": 3}},
        "required": ["name", "age"]}}},
]


def run(llm: LLM, prompts, params) -> tuple[float, int]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.token_ids) for o in outs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--backend", default="llguidance", help="llguidance (the default) or xgrammar")
    parser.add_argument("--only", choices=("schema", "tools"), default=None, help="run one half (default: both)")
    parser.add_argument("--tool-call-parser", default=None,
                        help="the call syntax (default: the model's own, else hermes)")
    parser.add_argument("--call-tokens", type=int, default=128, help="max_tokens of a forced call (it ends sooner)")
    parser.add_argument("--no-twin", action="store_true",
                        help="skip the forced calls with fast_forward=False (a second engine)")
    args = parser.parse_args()
    llm = LLM(args.model, device=args.device, max_num_seqs=max(64, args.batch),
              structured_output_backend=args.backend, tool_call_parser=args.tool_call_parser)
    print(f"grammar engine: {args.backend}; device: {args.device}; temperature {args.temperature}")
    if args.only != "tools":
        schema_workload(llm, args)
    if args.only != "schema":
        sampled = None if args.no_twin else LLM(args.model, device=args.device, max_num_seqs=max(64, args.batch),
                                                structured_output_backend=args.backend,
                                                tool_call_parser=args.tool_call_parser, fast_forward=False)
        tool_workload(llm, args, sampled)


def schema_workload(llm: LLM, args) -> None:
    prompts = [f"Record {i}: describe customer number {i} as JSON:" for i in range(args.batch)]
    free = SamplingParams(max_tokens=args.tokens, temperature=args.temperature, seed=0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=args.tokens, temperature=args.temperature, seed=0,
                                 structured_output={"json": SCHEMA})
    penalized = SamplingParams(max_tokens=args.tokens, temperature=args.temperature, seed=0, ignore_eos=True,
                               repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5)

    start = time.perf_counter()
    grammars = llm.core._make_grammars(llm.inputs.eos_token_ids)
    setup = time.perf_counter() - start
    constraint = parse_constraint({"json": SCHEMA})
    start = time.perf_counter()
    grammars.matcher(constraint)
    cold = time.perf_counter() - start
    start = time.perf_counter()
    grammars.matcher(constraint)
    cached = time.perf_counter() - start
    llm.core._grammars = grammars

    run(llm, prompts[:4], free)  # warm
    figures = {}
    runner = llm.core.executor
    for name, params in (("free", free), ("json schema", constrained), ("penalties", penalized),
                         ("free again", free)):
        stats = list(runner.masks.stats)
        elapsed, tokens = run(llm, prompts, params)
        figures[name] = tokens / elapsed
        steps, rows, filled = (after - before for after, before in zip(runner.masks.stats, stats))
        masks = f"; {rows} of {tokens} rows needed a mask, {filled} filled" if steps else ""
        print(f"{name:>12}: {tokens:5d} tokens in {elapsed:6.2f} s = {tokens / elapsed:8.1f} tok/s{masks}", flush=True)
    free_speed = (figures["free"] + figures["free again"]) / 2
    print(f"json schema / free: {figures['json schema'] / free_speed:.3f}x "
          f"(masking costs {100 * (1 - figures['json schema'] / free_speed):.1f}% of throughput)")
    print(f"penalties / free: {figures['penalties'] / free_speed:.3f}x "
          f"(penalties cost {100 * (1 - figures['penalties'] / free_speed):.1f}% of throughput)")
    print(f"grammar engine set-up for the tokenizer: {setup:.2f} s; schema compile: cold {cold * 1e3:.1f} ms, "
          f"cached {cached * 1e3:.3f} ms")


def run_chats(llm: LLM, chats, params, **tool_fields) -> tuple[float, list]:
    """(seconds, each chat's completion) of `chats` with TOOLS, one call at most each."""
    start = time.perf_counter()
    outs = llm.chat(chats, params, use_tqdm=False, tools=TOOLS, parallel_tool_calls=False, **tool_fields)
    return time.perf_counter() - start, [o.outputs[0] for o in outs]


def tool_workload(llm: LLM, args, sampled: LLM | None = None) -> None:
    """`sampled`: the same model with `fast_forward=False`, for the forced calls' twin row."""
    for each in (llm, sampled):
        if each is not None and each.tool_parser is None:  # (no call syntax in the model's template)
            each.client.tool_parser = get_tool_parser("hermes")
    chats = [[{"role": "user", "content": f"Customer {i} asks about the weather where they live. Help them."}]
             for i in range(args.batch)]
    same = llm.apply_chat_template(chats[0], tools=TOOLS) == llm.apply_chat_template(chats[0])
    print(f"tool calls: parser {llm.tool_parser.name}; "
          + ("the chat template ignores tools (the prompts are the same without them)" if same
             else "the tools are in the prompt, for the plain runs too"), flush=True)
    sampling = {"temperature": args.temperature, "seed": 0}
    forced = SamplingParams(max_tokens=args.call_tokens, **sampling)
    free = SamplingParams(max_tokens=args.tokens, ignore_eos=True, **sampling)
    for choice, params in (("required", forced), ("auto", free), ("none", free)):  # (warm: compile each grammar)
        run_chats(llm, chats[:2], params, tool_choice=choice)

    def report(name: str, elapsed: float, outs: list, note: str = "") -> float:
        tokens = sum(len(o.token_ids) for o in outs)
        print(f"{name:>24}: {tokens:5d} tokens in {elapsed:6.2f} s = {tokens / elapsed:8.1f} tok/s{note}", flush=True)
        return tokens / elapsed

    def forced_calls(engine: LLM, name: str) -> float:
        """Forced calls' throughput over their plain twin's: each row as many tokens as its call took."""
        elapsed, calls = run_chats(engine, chats, forced, tool_choice="required")
        valid = sum(bool(o.tool_calls) for o in calls)
        speed = report(name, elapsed, calls, f"; {valid} of {len(calls)} rows parsed into one call "
                                             f"({sum(len(o.token_ids) for o in calls) / len(calls):.0f} tokens a call)")
        twins = [free.clone(max_tokens=max(1, len(o.token_ids))) for o in calls]
        return speed / report("plain, same counts", *run_chats(engine, chats, twins, tool_choice="none"))

    required = forced_calls(llm, "required")
    if sampled is not None:  # the same calls with every token sampled under the mask
        run_chats(sampled, chats[:2], forced, tool_choice="required")
        print(f"required / plain (same counts), every token sampled: "
              f"{forced_calls(sampled, 'required, no fast-forward'):.3f}x")
    plain = report("plain", *run_chats(llm, chats, free, tool_choice="none"))
    elapsed, outs = run_chats(llm, chats, free, tool_choice="auto")
    started = sum(bool(o.tool_calls) or o.finish_reason == "tool_calls" for o in outs)
    auto = report("auto (no call starts)" if not started else "auto", elapsed, outs,
                  f"; {started} of {len(outs)} rows made a call")
    plain_again = report("plain again", *run_chats(llm, chats, free, tool_choice="none"))
    print(f"required / plain (same counts): {required:.3f}x "
          f"(forced calls cost {100 * (1 - required):.1f}% of throughput)")
    plain_speed = (plain + plain_again) / 2
    print(f"auto / plain: {auto / plain_speed:.3f}x (the idle lazy grammar costs "
          f"{100 * (1 - auto / plain_speed):.1f}% of throughput)")


if __name__ == "__main__":
    main()
