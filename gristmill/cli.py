"""Command line: `gristmill generate`, `gristmill serve` and `gristmill batch` (in gristmill/batch/cli.py)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from gristmill.batch.cli import add_batch_command
from gristmill.config import EngineConfig
from gristmill.engine_flags import (add_engine_args, engine_config, engine_options, failed_to_start, model_load_error,
                                    run_figures)
from gristmill.errors import EngineDeadError, RequestError, error_string
from gristmill.outputs import CompletionOutput, RequestOutput


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


def _sampling_params(args):
    from gristmill import SamplingParams

    try:
        return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                              top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.seed,
                              stop=args.stop, ignore_eos=args.ignore_eos)
    except RequestError as exc:
        raise SystemExit(f"error: {exc}") from None


def _read_rows(args) -> list[dict]:
    rows = [{"prompt": p} for p in args.prompts]
    if args.input:
        rows += _input_rows(args.input)
    if not rows:
        raise SystemExit("no prompts: pass prompts as arguments or --input FILE.jsonl")
    return rows


def _input_rows(path: str) -> list[dict]:
    """The rows of a --input JSONL file; a file that cannot be read stops the command, naming it."""
    from gristmill.batch.io import InputError, jsonl_rows

    rows = []
    try:
        for where, row in jsonl_rows(path):
            if "prompt" not in row and "messages" not in row:
                raise SystemExit(f"{where}: each line must be a JSON object with a 'prompt' string or a "
                                 f"'messages' list")
            rows.append(row)
    except OSError as exc:
        raise SystemExit(f"error: --input {path}: {exc.strerror}; pass a JSONL file") from None
    except InputError as exc:
        raise SystemExit(f"error: {exc}") from None
    return rows


def _check_output(path: str | None) -> None:
    """Before the model loads: the -o file can be written, so no generated row is lost."""
    from gristmill.batch.io import InputError, check_writable

    if path is not None:
        try:
            check_writable("--output", path)
        except InputError as exc:
            raise SystemExit(f"error: {exc}") from None


def _row_error(row: dict) -> RequestError | None:
    """Why this row cannot be generated, or None. Checked before the rows go to
    `LLM.generate`/`chat` together, where a wrong type could change how the whole list is read."""
    if "messages" in row:
        if isinstance(row["messages"], list):
            return None
        return RequestError(f"'messages' must be a list of {{'role': ..., 'content': ...}} objects, "
                            f"got {_json_kind(row['messages'])}", param="messages")
    prompt = row["prompt"]
    if isinstance(prompt, str) or (isinstance(prompt, list) and all(_is_int(t) for t in prompt)):
        return None
    return RequestError(f"'prompt' must be a string or a list of token ids (integers), got "
                        f"{_json_kind(prompt)}; write text as a JSON string", param="prompt")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _json_kind(value) -> str:
    """A JSON value as the person who wrote the file sees it: `a number: 5`, `null`, ..."""
    if value is None:
        return "null"
    text = json.dumps(value, ensure_ascii=False)
    text = text if len(text) <= 40 else text[:37] + "..."
    if isinstance(value, list):
        return f"a list with items that are not integers: {text}"
    kind = {bool: "a boolean", int: "a number", float: "a number", str: "a string", dict: "an object"}
    return f"{kind.get(type(value), type(value).__name__)}: {text}"


def _error_output(error: RequestError) -> RequestOutput:
    return RequestOutput("", None, [], [CompletionOutput(0, finish_reason="error", error=error_string(error))])


def generate_rows(llm, rows: list[dict], params) -> list[RequestOutput]:
    """One output per row, in order; an invalid row gets an error output and is not sent."""
    results: list[RequestOutput | None] = [None] * len(rows)
    plain, chats = [], []
    for i, row in enumerate(rows):
        error = _row_error(row)
        if error is not None:
            results[i] = _error_output(error)
        else:
            (chats if "messages" in row else plain).append(i)
    for i, out in zip(plain, llm.generate([rows[i]["prompt"] for i in plain], params)):
        results[i] = out
    for i, out in zip(chats, llm.chat([rows[i]["messages"] for i in chats], params)):
        results[i] = out
    return results


def _write_rows(output: str | None, rows: list[dict], results: list[RequestOutput]) -> None:
    sink = open(output, "w") if output else sys.stdout
    try:
        for row, out in zip(rows, results):
            record = dict(row, text=out.text, finish_reason=out.finish_reason, error=out.error or "",
                          num_prompt_tokens=len(out.prompt_token_ids),
                          num_generated_tokens=len(out.token_ids))
            sink.write(json.dumps(record, ensure_ascii=False) + "\n")
    finally:
        if output:
            sink.close()


def cmd_generate(args) -> int:
    from gristmill import LLM, startup

    config = engine_config(args)
    rows = _read_rows(args)
    params = _sampling_params(args)
    _check_output(args.output)
    startup.show_messages()
    try:
        # The core in a child process: it imports torch and loads the model while this
        # process loads the tokenizer, on a warm start the two longest steps of the start.
        llm = LLM(core_process=True, **dataclasses.asdict(config))
    except RequestError as exc:
        raise SystemExit(f"error: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - a model that cannot load: say why, not a traceback
        raise SystemExit(f"error: {model_load_error(config.model, exc)}") from None
    began = time.monotonic()
    try:
        results = generate_rows(llm, rows, params)
    except EngineDeadError as exc:
        raise SystemExit(f"error: {exc}") from None
    run_time = max(time.monotonic() - began, 1e-9)
    _write_rows(args.output, rows, results)
    failed = sum(1 for out in results if out.error)
    tokens = sum(len(out.token_ids) for out in results)
    print(f"{len(rows)} prompts, {len(rows) - failed} ok, {failed} failed; "
          f"{run_figures(len(rows), tokens, run_time, llm.start_seconds)}"
          + (f"; wrote {Path(args.output)}" if args.output else ""), file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    from gristmill.server.limits import ServerLimits
    from gristmill.server.lora_modules import served_loras

    config = engine_config(args)
    if (args.lora_modules or args.allow_runtime_lora) and not config.enable_lora:
        if engine_options(args).get("enable_lora") is False:
            raise SystemExit("error: --lora-modules and --allow-runtime-lora serve LoRA adapters, and "
                             "--no-enable-lora turns them off; leave one out")
        config = EngineConfig.from_kwargs(**{**engine_options(args), "enable_lora": True})
    try:  # (each adapter's config, checked before the model loads: a bad one ends the start naming it)
        served_loras("", config, args.lora_modules, args.allow_runtime_lora)
    except (ValueError, RequestError) as exc:
        raise SystemExit(f"error: {exc} (flag: --lora-modules)") from None
    try:
        limits = ServerLimits(max_request_bytes=args.max_request_bytes, max_prompt_chars=args.max_prompt_chars,
                              max_stream_buffer=args.max_stream_buffer, max_inputs=args.max_inputs)
    except RequestError as exc:
        raise SystemExit(f"error: {exc} (flag: --{exc.param.replace('_', '-')})") from None
    if args.max_engine_restarts < 0 or not args.restart_window_s > 0 or args.shutdown_grace_s < 0:
        raise SystemExit("error: --max-engine-restarts must be >= 0, --restart-window-s > 0 and "
                         "--shutdown-grace-s >= 0")
    sock = _bind(args.host, args.port)  # before the engine loads: a port in use fails in a second
    try:
        return _serve(args, config, limits, sock)
    finally:
        sock.close()


def _bind(host: str, port: int):
    """The socket the server will listen on, bound now; a port it cannot have exits naming it."""
    import errno

    from gristmill.server.run import bind_socket

    try:
        return bind_socket(host, port)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise SystemExit(f"error: port {port} on {host} is already in use (another server, or a gristmill serve "
                             f"still running); stop it, or pass a free port with --port") from None
        raise SystemExit(f"error: cannot listen on {host} port {port} ({exc.strerror or exc}); pass another "
                         f"--host or --port") from None


def _serve(args, config, limits, sock) -> int:
    import logging
    import signal

    import uvicorn

    from gristmill import startup
    from gristmill.engine.async_engine import AsyncEngine
    from gristmill.errors import EngineDeadError
    from gristmill.paths import DEFAULT_EMBEDDING_MODEL_NAME, DEFAULT_MODEL_NAME
    from gristmill.server.app import build_app
    from gristmill.server.lora_modules import served_loras
    from gristmill.server.run import DrainingServer

    startup.show_messages()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    started = time.monotonic()
    try:
        engine = AsyncEngine(config)
    except (RequestError, EngineDeadError) as exc:
        raise SystemExit(f"error: {model_load_error(config.model, exc) if failed_to_start(exc) else exc}") from None
    except Exception as exc:  # noqa: BLE001 - a model that cannot load: say why, not a traceback
        raise SystemExit(f"error: {model_load_error(config.model, exc)}") from None
    exit_code = 0
    server: DrainingServer | None = None

    def on_give_up(error):
        nonlocal exit_code
        if args.exit_on_engine_death and server is not None:
            logging.getLogger("gristmill.serve").error("engine dead, exiting: %s", error.message)
            exit_code = 1
            server.should_exit = True

    name = args.served_model_name or config.model or (
        DEFAULT_EMBEDDING_MODEL_NAME if engine.config.task in ("embed", "score") else DEFAULT_MODEL_NAME)
    loras = served_loras(name, config, args.lora_modules, args.allow_runtime_lora)
    app = build_app(engine, name, api_key=args.api_key, max_engine_restarts=args.max_engine_restarts,
                    restart_window_s=args.restart_window_s, start_seconds=time.monotonic() - started,
                    on_give_up=on_give_up, limits=limits, loras=loras)
    server = DrainingServer(uvicorn.Config(app, host=args.host, port=args.port, log_level="info",
                                           timeout_keep_alive=args.timeout_keep_alive,
                                           timeout_graceful_shutdown=5), shutdown_grace_s=args.shutdown_grace_s)
    # uvicorn re-raises a signal it handled once it is done; these make that a no-op.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        server.run(sockets=[sock])
    finally:
        engine.shutdown()
    return exit_code


def _port(text: str) -> int:
    """--port: a number in 0..65535 (uvicorn would take 70000 as 70000 - 65536)."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port: give a number in 0..65535")
    return port


def build_parser() -> argparse.ArgumentParser:
    from gristmill.server.limits import ServerLimits

    parser = argparse.ArgumentParser(prog="gristmill", description="LLM batch inference and serving.")
    commands = parser.add_subparsers(dest="command", metavar="command")
    generate = commands.add_parser(
        "generate", help="generate text for prompts (arguments or a JSONL file)",
        description="Generate for each prompt. JSONL input: one object per line with 'prompt' "
                    "(text) or 'messages' (chat); other fields are copied to the output.")
    generate.add_argument("prompts", nargs="*", help="prompt texts")
    generate.add_argument("--input", "-i", help="JSONL file of {'prompt': ...} or {'messages': [...]}")
    generate.add_argument("--output", "-o", help="JSONL file to write (default: stdout)")
    add_engine_args(generate)
    _add_sampling_args(generate)
    generate.set_defaults(func=cmd_generate)

    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server",
                                description="Serve OpenAI's /v1/completions, /v1/chat/completions, "
                                            "/v1/responses, /v1/embeddings (and the pooling routes), "
                                            "Anthropic's /v1/messages, /v1/models, /tokenize, /health and "
                                            "/metrics over one engine.")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=_port, default=8000, help="0..65535 (default: 8000)")
    serve.add_argument("--served-model-name", default=None, help="model name clients send (default: --model)")
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1")
    serve.add_argument("--max-engine-restarts", type=int, default=3,
                       help="times a dead or hung engine is restarted within --restart-window-s (default: 3)")
    serve.add_argument("--restart-window-s", type=float, default=600.0,
                       help="the window of time the restart budget counts over (default: 600)")
    serve.add_argument("--exit-on-engine-death", action="store_true",
                       help="exit (code 1) when the engine dies past its restart budget, for orchestrators "
                            "that restart the server")
    serve.add_argument("--timeout-keep-alive", type=float, default=65.0,
                       help="seconds an idle keep-alive connection stays open (default: 65). Keep it above "
                            "your clients' pool expiry (httpx and the openai client: 5 s), or a client may "
                            "send a request on a connection the server is closing")
    serve.add_argument("--shutdown-grace-s", type=float, default=30.0,
                       help="on SIGTERM, how long requests in flight may go on before they are aborted "
                            "(default: 30)")
    limits = ServerLimits()
    serve.add_argument("--max-request-bytes", type=int, default=limits.max_request_bytes,
                       help=f"largest request body (default: {limits.max_request_bytes})")
    serve.add_argument("--max-prompt-chars", type=int, default=limits.max_prompt_chars,
                       help=f"longest prompt, in characters (default: {limits.max_prompt_chars})")
    serve.add_argument("--max-inputs", type=int, default=limits.max_inputs,
                       help=f"most inputs of one embeddings or classify request, texts of one score or rerank "
                            f"request (default: {limits.max_inputs})")
    serve.add_argument("--max-stream-buffer", type=int, default=limits.max_stream_buffer,
                       help="outputs a stream may hold unread before its request is aborted "
                            f"(a reader too slow for it; default: {limits.max_stream_buffer})")
    serve.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                       help="LoRA adapters served by name (PEFT directories; a request's model names one), as "
                            "name=path or JSON {\"name\": ..., \"path\": ...}; turns --enable-lora on")
    serve.add_argument("--allow-runtime-lora", action="store_true",
                       help="take POST /v1/load_lora_adapter and /v1/unload_lora_adapter (also "
                            "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true); turns --enable-lora on")
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)

    add_batch_command(commands)
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
