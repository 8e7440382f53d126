"""The LoRA adapters a batch row may name, and how a row names one.

A row's `lora` column, else its `model` column, names the model it runs with: a LoRA
adapter, or the base model (its name, an empty value, or no column). An engine of the
processor's own, or a `gristmill.batch.deploy` deployment, is given its adapters by name
(`lora_modules={"name": "path"}`, `gristmill batch --lora-modules name=path`) and maps
each row's name to its `LoRARequest` here (`RowAdapters`); a server or a Ray Serve
deployment is sent the name as the request's `model` and maps it itself. A name that is
neither the base nor an adapter given is that row's RequestError, never the job's.
"""

from __future__ import annotations

import dataclasses
import os

from gristmill.config import EngineConfig
from gristmill.errors import LoRAAdapterError, RequestError
from gristmill.lora import LoRARequest, check_adapter

#: The columns that name a row's model, the first given winning.
MODEL_COLUMNS = ("lora", "model")
#: Slots an engine gets when lora_modules turn its adapters on (more adapters than slots
#: run in turns: docs/lora.md).
DEFAULT_MAX_LORAS = 4


def row_model(row: dict) -> str | None:
    """The model a row names (its `lora` value, else its `model` value); None: the
    processor's (no column, a null, an empty value, as CSV and Parquet rows have them)."""
    for column in MODEL_COLUMNS:
        value = row.get(column)
        if value is None or value == "" or value != value:  # (NaN: pandas' missing value)
            continue
        if not isinstance(value, str):
            raise RequestError(f"'{column}' names the row's model (a LoRA adapter, or the base model): it must be "
                               f"a string, got {type(value).__name__} {value!r}", param=column)
        return value
    return None


def check_lora_modules(modules) -> dict[str, str]:
    """`modules` ({"name": "path"}, or None) as a dict of adapter names to paths;
    RequestError (param "lora_modules") saying what to give otherwise."""
    if modules is None:
        return {}
    if not isinstance(modules, dict) or not all(isinstance(k, str) and k and isinstance(v, (str, os.PathLike))
                                                and str(v) for k, v in modules.items()):
        raise RequestError(f"lora_modules must be a dict of LoRA adapter names to their PEFT directories, such as "
                           f"{{'sql': '/adapters/sql-lora'}}, got {str(modules)[:200]}", param="lora_modules")
    return {name: os.fspath(path) for name, path in modules.items()}


def with_adapters(engine: EngineConfig, modules: dict[str, str]) -> EngineConfig:
    """The engine config that runs `modules`: enable_lora on (and, where the config did
    not turn it on itself, a slot per adapter, up to DEFAULT_MAX_LORAS)."""
    if not modules or engine.enable_lora:
        return engine
    return dataclasses.replace(engine, enable_lora=True,
                               max_loras=max(engine.max_loras, min(len(modules), DEFAULT_MAX_LORAS)))


def base_names(engine: EngineConfig) -> set[str]:
    """The names a row may give the base model: the engine's `model` as given (and its
    file or directory name), or the bundled default's name."""
    from gristmill.paths import DEFAULT_EMBEDDING_MODEL_NAME, DEFAULT_MODEL_NAME

    if engine.model is None:
        return {DEFAULT_MODEL_NAME, DEFAULT_EMBEDDING_MODEL_NAME}
    return {engine.model, os.path.basename(os.path.normpath(engine.model))}


class RowAdapters:
    """The adapters an engine's rows may name (`modules`: name -> PEFT directory, each
    given its own lora_int_id), beside the base model's names."""

    def __init__(self, engine: EngineConfig, modules: dict[str, str] | None = None):
        self.base = base_names(engine)
        self.max_lora_rank = engine.max_lora_rank
        self.loras = {name: LoRARequest(name, lora_id, path)
                      for lora_id, (name, path) in enumerate(check_lora_modules(modules).items(), start=1)}
        taken = sorted(self.base & set(self.loras))
        if taken:
            raise RequestError(f"lora_modules: the adapter name {taken[0]!r} is the base model's; give the adapter "
                               f"another name", param="lora_modules")

    def check(self) -> None:
        """Each adapter's config and weights file, before the engine starts: a bad one
        stops the start, named (LoRAAdapterError). Its weights are checked against the
        model when the engine first loads them: one that fails there fails its rows."""
        for lora in self.loras.values():
            try:
                check_adapter(lora, self.max_lora_rank)
            except LoRAAdapterError as exc:
                raise LoRAAdapterError(f"{exc.message} (given in lora_modules; gristmill batch: --lora-modules)",
                                       param="lora_modules", lora_name=lora.lora_name) from None

    def lora_of(self, name: str | None) -> LoRARequest | None:
        """The adapter a row's model name names; None for the base model."""
        if name is None or name in self.base:
            return None
        lora = self.loras.get(name)
        if lora is None:
            given = ", ".join(map(repr, self.loras)) or "none"
            raise RequestError(f"the row names the model {name!r}, which is neither the base model "
                               f"({', '.join(map(repr, sorted(self.base)))}) nor a LoRA adapter given to this "
                               f"processor (given: {given}); give it with lora_modules={{{name!r}: PATH}} "
                               f"(gristmill batch: --lora-modules {name}=PATH), or fix the row's 'model' / "
                               f"'lora' value", param="model")
        return lora
