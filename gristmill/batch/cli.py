"""`gristmill batch INPUT -o OUTPUT`: every row of a JSONL, CSV or Parquet file (or of an
OpenAI Batch API file) through a processor, written as it goes, each row exactly once.

This module is the command's flags; job.py runs a job, resume.py skips what an
interrupted job wrote (--resume), job_rows.py turns input rows into processor rows.
"""

from __future__ import annotations

import argparse
import os

from gristmill import extras
from gristmill.batch.resume import ROW_ID
from gristmill.engine_flags import add_engine_args


def add_batch_command(commands) -> None:
    parser = commands.add_parser(
        "batch", help="run every row of a JSONL / CSV / Parquet file (or an OpenAI batch file)",
        description="Generate for every row of INPUT and write OUTPUT as it goes (the format of each "
                    "follows its extension: .jsonl, .csv, .parquet). Each output row is the input row plus "
                    "its id and the output columns (generated_text, ..., __inference_error__). With --task "
                    "embed, classify or score the rows are pooled instead: the columns are embeddings, probs "
                    "or score (of each row's text_1 and text_2), num_input_tokens, time_taken_llm, "
                    "__inference_error__. An OpenAI Batch API file (lines with custom_id, method, url, body; "
                    "url /v1/chat/completions, /v1/completions or /v1/embeddings) gets OpenAI batch output lines.")
    parser.add_argument("input", help="rows to run: .jsonl, .csv or .parquet")
    parser.add_argument("-o", "--output", required=True, help="where the rows go: .jsonl, .csv or .parquet")
    columns = parser.add_mutually_exclusive_group()
    columns.add_argument("--prompt-column", metavar="C", help="column holding each row's prompt text "
                         "(default: 'prompt', or 'messages' when a row has it)")
    columns.add_argument("--messages-column", metavar="C", help="column holding each row's chat messages")
    parser.add_argument("--id-column", metavar="C", help="column whose (unique) values are the row ids "
                        f"(default: the input position, written as {ROW_ID})")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="default max_tokens of every row; a row's own sampling_params win (default: 16; "
                        "in an OpenAI batch file, a request without max_tokens runs to the context, as OpenAI's)")
    parser.add_argument("--temperature", type=float, default=None,
                        help="default temperature of every row, 0 = greedy (default: 1.0)")
    for name, what in (("repetition-penalty", "repetition_penalty (> 1 discourages repeats; default: 1, off)"),
                       ("presence-penalty", "presence_penalty, in [-2, 2] (default: 0, off)"),
                       ("frequency-penalty", "frequency_penalty, in [-2, 2] (default: 0, off)")):
        parser.add_argument(f"--{name}", type=float, default=None,
                            help=f"default {what} of every row; a row's own sampling_params win")
    parser.add_argument("--json-schema", metavar="FILE", help="constrain every row's output to this JSON schema "
                        "(a .json file); a row's own sampling_params.structured_output wins (false: none), as does an "
                        "OpenAI batch line's response_format ({\"type\": \"text\"}: none)")
    parser.add_argument("--chat-template-kwargs", metavar="JSON", default=None,
                        help="variables for every chat row's template, a JSON object such as "
                             "'{\"enable_thinking\": false}' (Qwen3); a row's own chat_template_kwargs are merged "
                             "over them (its values win, key by key)")
    parser.add_argument("--prompt-logprobs", type=int, default=None, metavar="K",
                        help="score each row's prompt: a prompt_logprobs column with each prompt token's logprob "
                             "after the ones before it (the first null), as evaluation harnesses score text")
    parser.add_argument("--dimensions", type=int, default=None,
                        help="--task embed: keep the first N values of each embedding (a Matryoshka model); a row's "
                             "own pooling_params win")
    parser.add_argument("--truncate-prompt-tokens", type=int, default=None, metavar="N",
                        help="pooling tasks: cut a prompt longer than N tokens to N (-1: to what the engine takes; "
                             "default: refuse it as an error row); a row's own pooling_params win")
    parser.add_argument("--fail-fast", action="store_true",
                        help="stop at the first row error, in input order, writing the rows before it "
                             "(default: write it as an error row and go on)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the rows an existing .jsonl/.csv OUTPUT holds and run only the rest "
                             "(default: overwrite OUTPUT)")
    parser.add_argument("--errors", metavar="FILE", help="also write each failed input row, as read, with "
                        "__inference_error__, to this .jsonl file (ready to run again)")
    parser.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                        help="LoRA adapters rows may name in their 'lora' or 'model' column (an OpenAI batch line: "
                             "in its body's model), each as name=path (a PEFT directory) or JSON {\"name\": ..., "
                             "\"path\": ...}, as serve's; turns --enable-lora on. A row naming another model than "
                             "the base or these is an error row")
    parser.add_argument("--max-engine-restarts", type=int, default=0,
                        help="times a dead engine is restarted during the job (default: 0)")
    parser.add_argument("--deployment-url", metavar="URL", help="send rows to this OpenAI-compatible server "
                        "(e.g. http://127.0.0.1:8000/v1; a URL without a path gets /v1) instead of a local engine")
    parser.add_argument("--api-key", metavar="KEY", default=os.environ.get("OPENAI_API_KEY"),
                        help="with --deployment-url: sent as 'Authorization: Bearer KEY' (default: "
                             "OPENAI_API_KEY when set)")
    parser.add_argument("--runner", choices=("local", *extras.BATCH_RUNNERS), default="local",
                        help="where the job runs: 'local', in this process (default), or 'ray', on Ray Data "
                             "(needs pip install 'gristmill[ray]'; see docs/ray.md)")
    parser.add_argument("--address", metavar="ADDR", help="with --runner ray: the Ray cluster to run on, e.g. "
                        "'auto' or 10.0.0.1:6379 (default: RAY_ADDRESS, else a new local cluster)")
    parser.add_argument("--concurrency", type=int, default=1,
                        help="engine replicas (with --runner ray, actors), each its own engine (default: 1); "
                             "on several GPUs, one on each in turn")
    parser.add_argument("--batch-size", type=int, default=64, help="rows per batch (default: 64)")
    parser.add_argument("--max-concurrent-batches", type=int, default=4,
                        help="batches in flight at once (default: 4)")
    add_engine_args(parser)
    parser.set_defaults(func=cmd_batch)


def cmd_batch(args: argparse.Namespace) -> int:
    # Here, not at the top: every command's parser is built from this module, and a job's
    # modules are no part of `gristmill generate`'s start.
    from gristmill import startup
    from gristmill.batch.io import InputError
    from gristmill.batch.job import Job, sigterm_interrupts

    startup.show_messages()
    try:
        job = Job(args)
    except (InputError, OSError) as exc:
        raise SystemExit(f"error: {exc}") from None
    with sigterm_interrupts():
        return job.run()
