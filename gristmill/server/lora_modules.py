"""The LoRA adapters a server serves by name (`gristmill serve --lora-modules name=path`):
a request whose `model` names one runs with it, `/v1/models` lists each beside the base
model, and with runtime updating allowed (`--allow-runtime-lora`, or vLLM's
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=true`) `POST /v1/load_lora_adapter` and
`/v1/unload_lora_adapter` (vLLM's bodies) add and remove them. Each adapter's config is
checked when it is added (at start, a bad one stops the start with its name); its weights
load in the engine the first time a request needs them, and an adapter that fails there
fails only the requests that named it."""

from __future__ import annotations

import os
import time

from pydantic import BaseModel, ConfigDict

from gristmill.errors import RequestError
from gristmill.lora import LoRARequest, check_adapter, parse_lora_module
from gristmill.server.errors import ModelNotFoundError

RUNTIME_ENV = ("GRISTMILL_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING")
LOAD_PATH, UNLOAD_PATH = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


class LoadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_path: str


class UnloadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_int_id: int | None = None  # (vLLM's body may carry it; the name decides)


def runtime_updating_allowed(flag: bool) -> bool:
    return flag or any(os.environ.get(name, "").lower() in ("1", "true") for name in RUNTIME_ENV)


class LoRAModules:
    """The served adapters by name. `enabled`: the engine runs adapters (enable_lora);
    `max_lora_rank`: the highest rank it takes; `runtime`: load/unload over HTTP allowed."""

    def __init__(self, base_name: str, enabled: bool, max_lora_rank: int, runtime: bool = False):
        self.base_name = base_name
        self.enabled = enabled
        self.max_lora_rank = max_lora_rank
        self.runtime = runtime
        self.adapters: dict[str, LoRARequest] = {}
        self.created: dict[str, int] = {}
        self._next_id = 1

    def add(self, lora: LoRARequest) -> LoRARequest:
        """Serve `lora` under its name, its config checked (LoRAAdapterError naming it)."""
        if not self.enabled:
            raise RequestError("this server was started without LoRA adapters; start it with --enable-lora (or "
                               "--lora-modules name=path)", param="lora_name")
        if lora.lora_name == self.base_name or lora.lora_name in self.adapters:
            raise RequestError(f"the name {lora.lora_name!r} is taken (the base model or an adapter already "
                               f"served); unload it first or choose another name", param="lora_name")
        lora = LoRARequest(lora.lora_name, self._next_id, lora.lora_path, lora.base_model_name)
        check_adapter(lora, self.max_lora_rank)
        self._next_id += 1
        self.adapters[lora.lora_name] = lora
        self.created[lora.lora_name] = int(time.time())
        return lora

    def remove(self, name: str) -> None:
        if self.adapters.pop(name, None) is None:
            raise ModelNotFoundError(f"no LoRA adapter named {name!r} is served (served: "
                                     f"{', '.join(self.adapters) or 'none'})", param="lora_name")
        self.created.pop(name, None)

    def get(self, name: str) -> LoRARequest | None:
        return self.adapters.get(name)

    def cards(self, created: int, max_model_len: int) -> list[dict]:
        """The adapters as /v1/models entries, each with its `parent` (the base model)."""
        return [{"id": name, "object": "model", "created": self.created.get(name, created), "owned_by": "gristmill",
                 "root": lora.lora_path, "parent": self.base_name, "max_model_len": max_model_len}
                for name, lora in self.adapters.items()]

    def check_runtime(self) -> None:
        if not self.runtime:
            raise RequestError("loading and unloading LoRA adapters at run time is off; start the server with "
                               "--allow-runtime-lora (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=true) and --enable-lora",
                               param="lora_name")


def served_loras(base_name: str, config, modules: list[str] | None, allow_runtime: bool) -> LoRAModules:
    """The adapters a server over an engine of `config` serves: `modules` (--lora-modules
    texts), each checked (ValueError or LoRAAdapterError naming a bad one)."""
    loras = LoRAModules(base_name, config.enable_lora, config.max_lora_rank, runtime_updating_allowed(allow_runtime))
    for text in modules or ():
        loras.add(parse_lora_module(text))
    return loras
