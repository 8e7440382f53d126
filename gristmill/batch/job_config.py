"""A `gristmill batch` job's flags as what it runs: its task (`job_task`) and its
processor config (`processor_config`: an engine of its own, or a server), each flag that
does not fit the job an InputError naming it, before the model loads."""

from __future__ import annotations

import argparse
import json

from gristmill.batch import EngineProcessorConfig, HttpProcessorConfig
from gristmill.batch.io import InputError
from gristmill.batch.openai_batch import batch_task
from gristmill.engine_flags import engine_config, engine_options
from gristmill.errors import RequestError
from gristmill.lora import parse_lora_module
from gristmill.sampling import SamplingParams


def job_task(args: argparse.Namespace, first_row: dict | None, batch_file: bool) -> str:
    """The job's task: --task, else an OpenAI batch file's (its first line's url), else
    the model's (an HF directory's: `tasks.resolve_task`), else "generate"."""
    given = engine_options(args).get("task", "auto")
    if given != "auto":
        return given
    if batch_file:
        return batch_task(first_row)
    model = engine_options(args).get("model")
    if model is not None and not args.deployment_url:
        from gristmill.paths import model_source
        from gristmill.tasks import resolve_task
        try:
            source = model_source(model, engine_options(args).get("cache_dir"))
        except (OSError, RuntimeError):  # (the engine's start says what is wrong with it)
            return "generate"
        if source.is_dir():  # (a name of a bundled model too; a GGUF file is a generative model)
            return resolve_task("auto", source)
    return "generate"


def processor_config(args: argparse.Namespace, task: str, id_column: str, batch_file: bool):
    """The processor config of the job's flags: an HttpProcessorConfig with --deployment-url,
    else an EngineProcessorConfig; InputError naming a flag that does not fit."""
    pooling = task != "generate"
    sampling_flags = [flag for flag, given in (
        ("--max-tokens", args.max_tokens), ("--temperature", args.temperature),
        ("--repetition-penalty", args.repetition_penalty), ("--presence-penalty", args.presence_penalty),
        ("--frequency-penalty", args.frequency_penalty), ("--json-schema", args.json_schema),
        ("--prompt-logprobs", args.prompt_logprobs)) if given is not None]
    pooling_flags = [flag for flag, given in (("--dimensions", args.dimensions),
                                              ("--truncate-prompt-tokens", args.truncate_prompt_tokens))
                     if given is not None]
    if pooling and sampling_flags:
        raise InputError(f"{', '.join(sampling_flags)} set how rows generate, and this job runs task "
                         f"{task!r}; leave {'it' if len(sampling_flags) == 1 else 'them'} out")
    if not pooling and pooling_flags:
        raise InputError(f"{', '.join(pooling_flags)} apply to a pooling job (--task embed, classify or score), "
                         f"and this one generates text; leave {'it' if len(pooling_flags) == 1 else 'them'} out "
                         f"or pass --task")
    defaults = {name: getattr(args, name) for name in ("max_tokens", "temperature", "repetition_penalty",
                                                       "presence_penalty", "frequency_penalty", "prompt_logprobs")
                if getattr(args, name) is not None}
    if batch_file and args.max_tokens is None and not pooling:
        defaults["max_tokens"] = None  # a request without max_tokens runs to the context, as OpenAI's
    if args.json_schema:
        defaults["structured_output"] = {"json": _read_schema(args.json_schema)}
    pooling_defaults = {name: getattr(args, name) for name in ("dimensions", "truncate_prompt_tokens")
                        if getattr(args, name) is not None}
    # Row errors always come back as error rows: --fail-fast stops at the first one in
    # input order (job.Job._write_one), not at whichever of a batch's rows failed first.
    common = dict(batch_size=args.batch_size, max_concurrent_batches=args.max_concurrent_batches,
                  should_continue_on_error=True, sampling_params=defaults, id_column=id_column,
                  task=task, pooling_params=pooling_defaults,
                  chat_template_kwargs=_template_kwargs(args.chat_template_kwargs))
    adapters = lora_modules(args)
    try:
        SamplingParams(**defaults)
        if args.deployment_url:
            return HttpProcessorConfig(url=_api_url(args.deployment_url), api_key=args.api_key, **common)
        return EngineProcessorConfig(engine=engine_config(args), max_engine_restarts=args.max_engine_restarts,
                                     concurrency=args.concurrency, lora_modules=adapters, **common)
    except RequestError as exc:
        flag = "--json-schema" if exc.param == "structured_output" else "--" + (exc.param or "").replace("_", "-")
        raise InputError(f"{exc} (flag {'--deployment-url' if flag == '--url' else flag})") from None


def lora_modules(args: argparse.Namespace) -> dict[str, str] | None:
    """--lora-modules as {name: path} (serve's syntax: name=path, or JSON)."""
    if not args.lora_modules:
        return None
    if args.deployment_url:
        raise InputError("--lora-modules gives a local engine its adapters; a server serves its own (gristmill "
                         "serve --lora-modules), and rows name them in their 'lora' or 'model' column: leave "
                         "--lora-modules out with --deployment-url")
    if engine_options(args).get("enable_lora") is False:
        raise InputError("--lora-modules runs LoRA adapters, and --no-enable-lora turns them off; leave one out")
    modules: dict[str, str] = {}
    for text in args.lora_modules:
        try:
            lora = parse_lora_module(text)
        except (ValueError, RequestError) as exc:
            raise InputError(str(exc)) from None
        if lora.lora_name in modules:
            raise InputError(f"--lora-modules names the adapter {lora.lora_name!r} twice; give each its own "
                             f"name")
        modules[lora.lora_name] = lora.lora_path
    return modules


def _read_schema(path: str) -> dict:
    try:
        with open(path) as f:
            schema = json.load(f)
    except OSError as exc:
        raise InputError(f"--json-schema {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise InputError(f"--json-schema {path} is not JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise InputError(f"--json-schema {path} must hold a JSON schema object, got {type(schema).__name__}")
    return schema


def _api_url(url: str) -> str:
    """http://host:port (no path) is read as the server's /v1 API."""
    from urllib.parse import urlsplit

    return url.rstrip("/") + "/v1" if urlsplit(url).path in ("", "/") else url


def _template_kwargs(text: str | None) -> dict | None:
    """--chat-template-kwargs: a JSON object of chat template variables."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"--chat-template-kwargs must be a JSON object such as '{{\"enable_thinking\": false}}': "
                         f"{exc}") from None
    if not isinstance(value, dict):
        raise InputError(f"--chat-template-kwargs must be a JSON object such as '{{\"enable_thinking\": false}}', "
                         f"got {type(value).__name__}")
    return value
