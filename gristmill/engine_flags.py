"""What the commands share: one flag per EngineConfig field (`generate`, `serve` and
`batch` all take them) and the throughput line `generate` and `batch` end with."""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing
from pathlib import Path

from gristmill.config import EngineConfig, field_doc
from gristmill.errors import EngineDeadError, InsufficientMemoryError, RequestError, error_string

# `generate` has a sampling --seed already; the engine's seed needs a name of its own.
_FLAG_NAMES = {"seed": "engine-seed"}
_FLAG_NOTES = {"seed": "(this is EngineConfig.seed; generate's --seed is the sampling seed)"}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field, typed and documented from the field itself."""
    group = parser.add_argument_group("engine", "EngineConfig fields; a flag left out keeps the config's default")
    annotations = typing.get_type_hints(EngineConfig)
    for config_field in dataclasses.fields(EngineConfig):
        name = config_field.name
        kind = _flag_type(name, annotations[name])
        parsing = (dict(action=argparse.BooleanOptionalAction) if kind is bool
                   else dict(type=kind, metavar=name.upper()))
        # SUPPRESS: a flag not given sets no attribute, so EngineConfig's own default applies.
        group.add_argument(engine_flag(name), dest=_engine_dest(name), default=argparse.SUPPRESS,
                           help=_flag_help(config_field), **parsing)


def engine_options(args: argparse.Namespace) -> dict:
    """The EngineConfig fields given as flags, by field name; fields not given are left out."""
    return {f.name: getattr(args, _engine_dest(f.name)) for f in dataclasses.fields(EngineConfig)
            if hasattr(args, _engine_dest(f.name))}


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of the flags given; an invalid value exits with the config's message."""
    try:
        return EngineConfig.from_kwargs(**engine_options(args))
    except RequestError as exc:
        raise SystemExit(f"error: {exc} (flag: {engine_flag(exc.param)})") from None


def run_figures(rows: int, tokens: int, run_time: float, start_seconds: float | None,
                generated: bool = True) -> str:
    """Throughput over the time rows ran, and the engine's start apart from it; `tokens`
    are generated ones, or (not `generated`: a pooling job) the prompts' tokens."""
    figures = (f"{rows / run_time:.2f} rows/s, {tokens / run_time:.1f} {'generated' if generated else 'input'} "
               f"tokens/s over {run_time:.1f} s of {'generation' if generated else 'pooling'}")
    if start_seconds is not None:
        figures += f" (engine start: {start_seconds:.1f} s, not counted)"
    return figures


def engine_flag(name: str) -> str:
    return "--" + _FLAG_NAMES.get(name, name.replace("_", "-"))


def _engine_dest(name: str) -> str:
    # Prefixed so no engine field can collide with a command's own flags (generate's args.seed).
    return f"engine_{name}"


def _flag_type(name: str, annotation) -> type:
    """What a field's flag parses to: its annotation, with `X | None` read as X."""
    types = [t for t in typing.get_args(annotation) or (annotation,) if t is not type(None)]
    if len(types) != 1 or types[0] not in (int, float, str, bool):
        raise TypeError(f"EngineConfig.{name}: a flag cannot parse {annotation}; annotate the field "
                        f"int, float, str or bool (optionally | None)")
    return types[0]


def _flag_help(config_field: dataclasses.Field) -> str:
    parts = [field_doc(config_field), f"(default: {config_field.default})", _FLAG_NOTES.get(config_field.name)]
    # argparse %-formats help strings; a literal % in a doc would break --help.
    return " ".join(p for p in parts if p).replace("%", "%%")


def model_load_error(model: str | None, exc: BaseException) -> str:
    """What `generate`, `serve` and `batch` say when the engine could not load `model`."""
    if model is not None and not Path(model).expanduser().exists():
        return str(exc)  # the loader's own "model ... not found: pass ..."
    # A core process that failed to start: its own error, not "restart the engine".
    why = getattr(exc, "fields", {}).get("core_error") or error_string(exc)
    where = f"the model could not be loaded from {model or 'the bundled default'}"
    if _out_of_memory(exc, why) or _SETTING.search(why):  # `why` says what to change: the file is fine
        return f"{where}: {why}"
    return f"{where}: {why}; check that the model directory or file is complete (re-download or re-convert it)"


def failed_to_start(exc: BaseException) -> bool:
    """Whether `exc` is an engine core's own report that it could not start (the loader
    refused the file, a setting was refused): every face says it as `model_load_error`."""
    return isinstance(exc, EngineDeadError) and bool(exc.fields.get("core_error"))


# A setting of ours refused (GRISTMILL_MAX_ISA='avx3': ...), not the model's files.
_SETTING = re.compile(r"\bGRISTMILL_[A-Z_]+=")


def _out_of_memory(exc: BaseException, why: str) -> bool:
    return isinstance(exc, InsufficientMemoryError) or InsufficientMemoryError.__name__ in why \
        or "ran out of memory" in why
