"""Command line: `gristmill generate` (and more to come: serve, batch, bench)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=None,
                       help="HF model directory or .gguf file (default: bundled Gemma 3 270M)")
    group.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output, in tokens")
    group.add_argument("--max-num-seqs", type=int, default=128, help="most requests running at once")
    group.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    group.add_argument("--kv-cache-memory-gb", type=float, default=1.0, help="memory for the KV cache")
    group.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    group.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")


def _engine_options(args) -> dict:
    return dict(model=args.model, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                kv_cache_memory_gb=args.kv_cache_memory_gb, device=args.device, dtype=args.dtype)


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=64)
    group.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--seed", type=int, default=None)
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true")


def _read_rows(args) -> list[dict]:
    rows = [{"prompt": p} for p in args.prompts]
    if args.input:
        with open(args.input) as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise SystemExit(f"{args.input}:{number}: not valid JSON ({exc}); "
                                     f"each line must be an object with 'prompt' or 'messages'") from None
                if not isinstance(row, dict) or ("prompt" not in row and "messages" not in row):
                    raise SystemExit(f"{args.input}:{number}: each line must be a JSON object with a "
                                     f"'prompt' string or a 'messages' list")
                rows.append(row)
    if not rows:
        raise SystemExit("no prompts: pass prompts as arguments or --input FILE.jsonl")
    return rows


def cmd_generate(args) -> int:
    from gristmill import LLM, SamplingParams
    from gristmill.errors import RequestError

    rows = _read_rows(args)
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.seed,
                                stop=args.stop, ignore_eos=args.ignore_eos)
        llm = LLM(**_engine_options(args))
    except RequestError as exc:
        raise SystemExit(f"error: {exc}") from None
    plain = [i for i, row in enumerate(rows) if "messages" not in row]
    chats = [i for i, row in enumerate(rows) if "messages" in row]
    results = [None] * len(rows)
    for i, out in zip(plain, llm.generate([rows[i]["prompt"] for i in plain], params)):
        results[i] = out
    for i, out in zip(chats, llm.chat([rows[i]["messages"] for i in chats], params)):
        results[i] = out
    sink = open(args.output, "w") if args.output else sys.stdout
    try:
        for row, out in zip(rows, results):
            record = dict(row, text=out.text, finish_reason=out.finish_reason, error=out.error or "",
                          num_prompt_tokens=len(out.prompt_token_ids),
                          num_generated_tokens=len(out.token_ids))
            sink.write(json.dumps(record, ensure_ascii=False) + "\n")
    finally:
        if args.output:
            sink.close()
    failed = sum(1 for out in results if out.error)
    print(f"{len(rows)} prompts, {len(rows) - failed} ok, {failed} failed"
          + (f"; wrote {Path(args.output)}" if args.output else ""), file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    import logging
    import signal

    import uvicorn

    from gristmill.engine.async_engine import AsyncEngine
    from gristmill.errors import EngineDeadError, RequestError
    from gristmill.model.loader import DEFAULT_MODEL_NAME
    from gristmill.server.app import build_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine = AsyncEngine(**_engine_options(args), step_timeout_s=args.step_timeout_s,
                             max_waiting_requests=args.max_waiting_requests)
    except (RequestError, EngineDeadError) as exc:
        raise SystemExit(f"error: {exc}") from None
    name = args.served_model_name or args.model or DEFAULT_MODEL_NAME
    app = build_app(engine, name, api_key=args.api_key)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="info",
                                           timeout_graceful_shutdown=5))
    exit_code = 0

    def on_engine_death(error):
        nonlocal exit_code
        if args.exit_on_engine_death:
            logging.getLogger("gristmill.serve").error("engine died, exiting: %s", error)
            exit_code = 1
            server.should_exit = True

    engine.add_failure_callback(on_engine_death)
    # uvicorn handles SIGINT/SIGTERM while it runs (graceful shutdown), then re-raises the
    # signal to the handlers it found; these make that a clean exit through `finally`.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        server.run()
    finally:
        engine.shutdown()
    return exit_code


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gristmill", description="LLM batch inference and serving.")
    commands = parser.add_subparsers(dest="command", metavar="command")
    generate = commands.add_parser(
        "generate", help="generate text for prompts (arguments or a JSONL file)",
        description="Generate for each prompt. JSONL input: one object per line with 'prompt' "
                    "(text) or 'messages' (chat); other fields are copied to the output.")
    generate.add_argument("prompts", nargs="*", help="prompt texts")
    generate.add_argument("--input", "-i", help="JSONL file of {'prompt': ...} or {'messages': [...]}")
    generate.add_argument("--output", "-o", help="JSONL file to write (default: stdout)")
    _add_engine_args(generate)
    _add_sampling_args(generate)
    generate.set_defaults(func=cmd_generate)

    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server",
                                description="Serve /v1/completions, /v1/chat/completions, /v1/models, "
                                            "/health and /metrics over one engine.")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None, help="model name clients send (default: --model)")
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1")
    serve.add_argument("--exit-on-engine-death", action="store_true",
                       help="exit (code 1) when the engine dies, for orchestrators that restart it")
    serve.add_argument("--step-timeout-s", type=float, default=60.0,
                       help="an engine step longer than this is a hang")
    serve.add_argument("--max-waiting-requests", type=int, default=None,
                       help="past this many waiting requests, answer 503 with Retry-After")
    _add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
