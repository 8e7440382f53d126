"""LoRA adapters as requests name them: `LoRARequest` (vLLM's), and what a PEFT adapter
directory's `adapter_config.json` says, read and checked without torch (the client and
the engine core both read it; the weights are the model's: gristmill/model/lora.py).

An adapter is a PEFT LoRA directory: `adapter_config.json` and `adapter_model.safetensors`
(or `adapter_model.bin`), over the projections q/k/v/o and gate/up/down of the model it
runs on; or llama.cpp's LoRA GGUF file of one (gristmill/lora_gguf.py). Anything PEFT can add that changes the arithmetic beyond `W x + s * B A x`
(DoRA, LoRA biases, modules_to_save, ...) is refused, never ignored.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from gristmill.errors import LoRAAdapterError
from gristmill.lora_gguf import adapter_fields, is_gguf_adapter

#: The projections an adapter may update, as PEFT (and the checkpoints) name them.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")

# PEFT options that change the arithmetic: an adapter with any of them set is refused.
_UNSUPPORTED = {"use_dora": "DoRA", "modules_to_save": "modules_to_save (whole layers trained)",
                "lora_bias": "LoRA biases", "fan_in_fan_out": "fan_in_fan_out (Conv1D layers)",
                "layer_replication": "layer_replication", "target_parameters": "target_parameters",
                "trainable_token_indices": "trainable_token_indices", "alora_invocation_tokens": "aLoRA",
                "use_qalora": "QA-LoRA", "use_bdlora": "BD-LoRA"}


@dataclass(frozen=True)
class LoRARequest:
    """An adapter a request runs with, as vLLM's `LoRARequest(lora_name, lora_int_id,
    lora_path)`: `lora_int_id` (> 0) names the adapter inside the engine (its slot, its
    prefix-cache blocks), so give each adapter its own id; `lora_path` is its PEFT
    directory, or its llama.cpp LoRA GGUF file."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    #: The model it was trained on, as vLLM takes it; informative only (shapes are checked).
    base_model_name: str | None = field(default=None, compare=False)

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise LoRAAdapterError(f"LoRARequest.lora_name must be a non-empty string, got {self.lora_name!r}",
                                   lora_name=str(self.lora_name))
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise LoRAAdapterError(f"LoRARequest {self.lora_name!r}: lora_int_id must be an integer > 0, got "
                                   f"{self.lora_int_id!r}", lora_name=self.lora_name)
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise LoRAAdapterError(f"LoRARequest {self.lora_name!r}: lora_path must be the adapter's directory "
                                   f"(adapter_config.json and adapter_model.safetensors) or LoRA GGUF file, got "
                                   f"{self.lora_path!r}",
                                   lora_name=self.lora_name)

    # vLLM's accessors
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    @property
    def cache_key(self) -> bytes:
        """What starts the prefix-cache hash chain of its requests' blocks: two adapters
        (or an adapter and the base) never share a KV block."""
        return hashlib.blake2b(f"lora\0{self.lora_int_id}\0{self.lora_path}".encode(), digest_size=16).digest()

    def same_adapter(self, other: "LoRARequest") -> bool:
        return (self.lora_int_id, self.lora_name, self.lora_path) == (other.lora_int_id, other.lora_name,
                                                                    other.lora_path)


def as_lora_request(value, param: str = "lora_request") -> LoRARequest | None:
    """`value` as a LoRARequest (None stays None); anything else is a RequestError."""
    if value is None or isinstance(value, LoRARequest):
        return value
    from gristmill.errors import RequestError
    raise RequestError(f"{param} must be a gristmill.LoRARequest(lora_name, lora_int_id, lora_path) or None, got "
                       f"{type(value).__name__}", param=param)


@dataclass(frozen=True)
class AdapterConfig:
    """What an adapter's adapter_config.json says that the arithmetic needs."""

    name: str
    path: Path
    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...] | str
    rank_pattern: dict
    alpha_pattern: dict
    base_model: str | None
    #: A llama.cpp LoRA GGUF's architecture (its file is `path`), else None: a PEFT directory.
    gguf_arch: str | None = None

    def rank_of(self, module: str) -> int:
        """The rank PEFT gives `module` (a dotted name): its rank_pattern's, or r."""
        return int(_pattern_value(self.rank_pattern, module, self.r))

    def scale_of(self, module: str) -> float:
        """PEFT's scaling of `module`'s update: alpha / r, or alpha / sqrt(r) (rsLoRA)."""
        r = self.rank_of(module)
        alpha = float(_pattern_value(self.alpha_pattern, module, self.lora_alpha))
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r


def read_adapter_config(lora: LoRARequest, max_lora_rank: int) -> AdapterConfig:
    """The adapter's config, checked: a LoRA (PEFT's `peft_type` LORA) of rank at most
    `max_lora_rank`, over supported modules, with nothing that changes the arithmetic.
    LoRAAdapterError naming the adapter and what does not fit otherwise."""
    name = lora.lora_name
    path = Path(lora.lora_path).expanduser()
    if is_gguf_adapter(path):
        return _gguf_config(name, path, max_lora_rank)
    config_file = path / CONFIG_FILE
    if not config_file.is_file():
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {config_file} does not exist; lora_path must be a PEFT "
                               f"adapter directory ({CONFIG_FILE} and {WEIGHT_FILES[0]})", lora_name=name)
    try:
        raw = json.loads(config_file.read_text())
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
    except (ValueError, OSError, UnicodeDecodeError) as exc:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {config_file} is not a readable JSON object ({exc})",
                               lora_name=name) from None
    kind = raw.get("peft_type", "LORA")
    if kind != "LORA":
        raise LoRAAdapterError(f"LoRA adapter {name!r}: peft_type is {kind!r}; only LORA adapters run",
                               lora_name=name)
    unsupported = [label for key, label in _UNSUPPORTED.items() if raw.get(key)]
    if raw.get("bias", "none") != "none":
        unsupported.append(f"bias={raw['bias']!r}")
    if unsupported:
        raise LoRAAdapterError(f"LoRA adapter {name!r} uses {', '.join(unsupported)}, which gristmill does not "
                               f"run; use a plain LoRA adapter (or merge this one into the model)", lora_name=name)
    r, alpha = raw.get("r"), raw.get("lora_alpha", raw.get("r"))
    if not isinstance(r, int) or isinstance(r, bool) or r < 1 or not isinstance(alpha, (int, float)):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: r must be a positive integer and lora_alpha a number, got "
                               f"r={r!r}, lora_alpha={alpha!r}", lora_name=name)
    targets = raw.get("target_modules")
    if isinstance(targets, list):
        outside = sorted(set(targets) - set(TARGET_MODULES))
        if outside:
            raise LoRAAdapterError(f"LoRA adapter {name!r} targets {outside}; adapters may target only "
                                   f"{list(TARGET_MODULES)}", lora_name=name)
        targets = tuple(targets)
    config = AdapterConfig(name, path, r, float(alpha), bool(raw.get("use_rslora")), targets or (),
                           dict(raw.get("rank_pattern") or {}), dict(raw.get("alpha_pattern") or {}),
                           raw.get("base_model_name_or_path"))
    _check_rank(config, max_lora_rank)
    return config


def _gguf_config(name: str, path: Path, max_lora_rank: int) -> AdapterConfig:
    """A llama.cpp LoRA GGUF's config: its alpha, and each module's rank (that of its A)."""
    fields = adapter_fields(name, path)
    if not fields["ranks"]:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {path} holds no LoRA weights", lora_name=name)
    ranks = {re.escape(module): rank for module, rank in fields["ranks"].items()}
    config = AdapterConfig(name, path, max(ranks.values()), fields["alpha"], False, fields["targets"], ranks, {},
                           f"a {fields['arch']} model", gguf_arch=fields["arch"])
    _check_rank(config, max_lora_rank)
    return config


def _check_rank(config: AdapterConfig, max_lora_rank: int) -> None:
    rank = max([config.r, *config.rank_pattern.values()])
    if rank > max_lora_rank:
        raise LoRAAdapterError(f"LoRA adapter {config.name!r} has rank {rank}, more than max_lora_rank="
                               f"{max_lora_rank}; start the engine with max_lora_rank >= {rank}",
                               lora_name=config.name)


def weight_file(config: AdapterConfig) -> Path:
    """The adapter's weights file: adapter_model.safetensors, else adapter_model.bin (a
    LoRA GGUF: the file itself)."""
    if config.gguf_arch is not None:
        return config.path
    for file_name in WEIGHT_FILES:
        if (config.path / file_name).is_file():
            return config.path / file_name
    raise LoRAAdapterError(f"LoRA adapter {config.name!r}: {config.path} has no {WEIGHT_FILES[0]} (nor "
                           f"{WEIGHT_FILES[1]})", lora_name=config.name)


def check_adapter(lora: LoRARequest, max_lora_rank: int) -> None:
    """What can be checked of an adapter before an engine loads it: its config
    (`read_adapter_config`) and that its weights file is there; LoRAAdapterError naming it.
    Its weights' shapes are checked against the model when the engine loads them."""
    weight_file(read_adapter_config(lora, max_lora_rank))


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: the value of the first key that matches
    the end of `module`'s dotted name (as a regular expression), else `default`."""
    for key, value in patterns.items():
        if re.fullmatch(rf"(.*\.)?{key}", module):
            return value
    return default


def parse_lora_module(text: str) -> LoRARequest:
    """`name=path`, or vLLM's JSON `{"name": ..., "path": ..., "base_model_name": ...}`, as
    a LoRARequest (its id given when it is added); ValueError saying what to send."""
    text = text.strip()
    if text.startswith("{"):
        try:
            spec = json.loads(text)
            return LoRARequest(spec["name"], 1, spec["path"], spec.get("base_model_name"))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"--lora-modules {text[:80]!r}: JSON must be {{\"name\": ..., \"path\": ...}} ({exc})")
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {text[:80]!r}: give each adapter as name=path (its PEFT directory or "
                         f"LoRA GGUF file)")
    return LoRARequest(name, 1, path)
