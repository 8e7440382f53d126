"""What a model needs in memory on CPU, and what the machine (or its container) has: the
check an engine makes before it loads anything, and the figures its client gives when
the core is killed for memory. Imports no torch.

A CPU engine holds its weights as stored (a GGUF's bytes, or an HF checkpoint's after
quantization), its KV cache, and about a gigabyte besides (torch, the tokenizer, the
activations of a step). Memory available is the least of the machine's (MemAvailable)
and the container's (its cgroup's limit less what the cgroup uses, page cache that can
be dropped aside), or GRISTMILL_AVAILABLE_MEMORY where it is set (e.g. "6GB"; for tests
and for leaving room to other processes).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from gristmill.errors import InsufficientMemoryError

AVAILABLE_ENV = "GRISTMILL_AVAILABLE_MEMORY"
# What an engine takes beyond its weights and KV cache.
OVERHEAD_BYTES = 1 << 30
# What a GGUF model's layers may take besides, in panels packed once at load (what the
# kernel otherwise lays out afresh at every call of many rows: cpu/quant.pack_panels),
# out of the memory left once the engine's need is met; PANEL_ENV sets another figure.
PANEL_BYTES = 128 << 20
PANEL_ENV = "GRISTMILL_PANEL_BYTES"
_GB = 1 << 30
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
          "g": _GB, "gb": _GB, "gib": _GB, "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}
# A cgroup v1 "no limit" is a huge number, rounded to pages.
_NO_LIMIT = 1 << 60


def parse_size(text: str, name: str = AVAILABLE_ENV) -> int:
    """Bytes of "12GB", "512 MiB", "1.5g" or "123456" (units of 1024); `name` is what the
    error names."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(f"{name}={text!r}: give a size such as 6GB, 512MiB or a number of bytes")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def available_memory(root: Path = Path("/")) -> tuple[int, str]:
    """(bytes available, where that figure comes from)."""
    if os.environ.get(AVAILABLE_ENV):
        return parse_size(os.environ[AVAILABLE_ENV]), AVAILABLE_ENV
    found = []
    machine = _meminfo_available(root / "proc/meminfo")
    if machine is not None:
        found.append((machine, "MemAvailable of this machine"))
    container = _cgroup_available(root / "sys/fs/cgroup")
    if container is not None:
        found.append(container)
    if not found:
        return _NO_LIMIT, "unknown (no /proc/meminfo or cgroup to read)"
    return min(found)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _meminfo_available(path: Path) -> int | None:
    text = _read(path)
    match = re.search(r"^MemAvailable:\s+(\d+) kB", text or "", re.M)
    return None if match is None else int(match.group(1)) * 1024


def _stat_value(text: str | None, key: str) -> int:
    match = re.search(rf"^{key} (\d+)$", text or "", re.M)
    return 0 if match is None else int(match.group(1))


def _cgroup_available(root: Path) -> tuple[int, str] | None:
    """The container's limit less its use (not counting page cache it could drop): cgroup
    v2 (memory.max, memory.current) or v1 (memory/memory.limit_in_bytes, usage_in_bytes)."""
    for limit_file, usage_file, stat_file, inactive, version in (
            (root / "memory.max", root / "memory.current", root / "memory.stat", "inactive_file", "v2"),
            (root / "memory/memory.limit_in_bytes", root / "memory/memory.usage_in_bytes",
             root / "memory/memory.stat", "total_inactive_file", "v1")):
        limit, usage = _read(limit_file), _read(usage_file)
        if limit is None or usage is None or limit.strip() == "max":
            continue
        try:
            limit_bytes, used = int(limit), int(usage)
        except ValueError:
            continue
        if limit_bytes >= _NO_LIMIT:
            continue
        used -= _stat_value(_read(stat_file), inactive)
        return (max(0, limit_bytes - max(0, used)),
                f"the container's memory limit less its use: cgroup {version}, {_gb(limit_bytes)} limit, "
                f"{_gb(max(0, used))} in use")
    return None


def oom_kills(root: Path = Path("/")) -> int | None:
    """How many processes the kernel's OOM killer has ended in this container (cgroup v2
    memory.events' oom_kill), or None where that is not to be read."""
    text = _read(root / "sys/fs/cgroup/memory.events")
    return None if text is None else _stat_value(text, "oom_kill")


def _gb(n: int) -> str:
    return f"{n / _GB:.1f} GB"


@dataclass(frozen=True)
class MemoryNeed:
    """What an engine will hold, and what there is."""

    model: str
    weights: int
    weights_how: str  # "as stored (Q4_K, Q6_K)", "int8", ...
    kv_cache: int
    kv_how: str
    available: int
    available_how: str
    overhead: int = OVERHEAD_BYTES

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.overhead

    @property
    def panel_budget(self) -> int:
        """Bytes of panels a GGUF model may pack once at load: PANEL_BYTES (or PANEL_ENV's
        figure), or what is available beyond the need where that is less."""
        wanted = parse_size(os.environ[PANEL_ENV], PANEL_ENV) if os.environ.get(PANEL_ENV) else PANEL_BYTES
        return max(0, min(wanted, self.available - self.total))

    def figures(self) -> str:
        return (f"{self.model} needs about {_gb(self.total)}: weights {_gb(self.weights)} ({self.weights_how}) "
                f"+ KV cache {_gb(self.kv_cache)} ({self.kv_how}) + {_gb(self.overhead)} for the rest; "
                f"{_gb(self.available)} available ({self.available_how})")

    def advice(self) -> str:
        return ("to fit, use a smaller quantization of the model (e.g. a Q4_K_M file instead of Q8_0 or F16), "
                "a smaller KV cache (kv_cache_memory_gb, or a shorter max_model_len and fewer max_num_seqs), "
                "or a machine or container with more memory")

    def check(self) -> None:
        """Raise InsufficientMemoryError when the engine cannot fit."""
        if self.total > self.available:
            raise InsufficientMemoryError(f"the model does not fit in memory: {self.figures()}; {self.advice()}",
                                          needed=self.total, available=self.available)


def weight_bytes(model_dir: Path, quantization: str | None, dtype_bytes: int = 4) -> tuple[int, str]:
    """(bytes the weights take when loaded, how they are held)."""
    from gristmill.model.loader.gguf_model import GGUF_LINK, KERNEL_TYPES

    link = model_dir / GGUF_LINK
    if link.exists():
        from gristmill.gguf_file import open_gguf

        tensors = [(t.n_elements, t.n_bytes, t.tensor_type.name, len(t.shape)) for t in open_gguf(link).tensors]
        if quantization == "gguf":
            total = sum(n_bytes if kind in KERNEL_TYPES or dims < 2 else _int8_bytes(n)
                        for n, n_bytes, kind, dims in tensors)
            kinds = sorted({kind for _, _, kind, dims in tensors if dims >= 2})
            return total, f"as stored: {', '.join(kinds)}"
        shapes = [(n, dims) for n, _, _, dims in tensors]
    else:
        from gristmill.model.loader.safetensors_io import SafetensorsReader

        shapes = []
        for file in sorted(model_dir.glob("*.safetensors")):
            with SafetensorsReader(file) as reader:
                shapes += [(math.prod(reader.entry(k)["shape"]), len(reader.entry(k)["shape"])) for k in reader.keys()]
    if quantization in ("int8", "q4", "gguf"):
        per_value = {"q4": 20 / 32}.get(quantization, 36 / 32)  # codes + fp16 scale + a sum or minimum per 32
        return sum(math.ceil(n * per_value) if dims >= 2 else 4 * n for n, dims in shapes), quantization
    return sum(dtype_bytes * n for n, _ in shapes), f"{8 * dtype_bytes}-bit floats"


def _int8_bytes(n: int) -> int:
    return math.ceil(n * 36 / 32)


def kv_cache_bytes(hf_config, config, max_model_len: int, dtype_bytes: int = 4) -> tuple[int, str]:
    """(bytes of KV cache the engine may fill, how that follows from the config)."""
    if hf_config.model_type == "bert":  # an encoder keeps no KV cache
        return 0, "none: an encoder"
    per_token = 2 * hf_config.num_hidden_layers * hf_config.num_key_value_heads * hf_config.head_dim * dtype_bytes
    if per_token == 0:
        return 0, "none"
    if config.num_kv_blocks:
        pool, how = config.num_kv_blocks * config.block_size * per_token, f"num_kv_blocks={config.num_kv_blocks}"
    else:
        gb = config.kv_cache_memory_gb if config.kv_cache_memory_gb is not None else 1.0
        pool, how = int(gb * _GB), f"kv_cache_memory_gb={gb:g}"
    seqs = config.max_num_seqs or 1
    used = min(pool, seqs * max_model_len * per_token)
    return used, (f"{how}; {max_model_len} tokens (max_model_len) x {seqs} sequences (max_num_seqs) "
                  f"at {per_token // 1024} KB a token")


def cpu_memory_need(model_dir: Path, hf_config, config, max_model_len: int, quantization: str | None,
                    dtype_bytes: int = 4) -> MemoryNeed:
    """What an engine of `config` on CPU will need, and what is available."""
    weights, weights_how = weight_bytes(model_dir, quantization, dtype_bytes)
    if getattr(config, "enable_lora", False):
        weights += lora_slot_bytes(hf_config, config.max_loras, config.max_lora_rank, dtype_bytes)
        weights_how += f" + {config.max_loras} LoRA slot(s) of rank {config.max_lora_rank}"
    kv_bytes = {"auto": dtype_bytes, "float32": 4}.get(config.kv_cache_dtype, 2)  # (float16, bfloat16)
    kv, kv_how = kv_cache_bytes(hf_config, config, max_model_len, kv_bytes)
    available, available_how = available_memory()
    from gristmill.model.loader.gguf_model import GGUF_LINK

    link = model_dir / GGUF_LINK
    name = link.resolve().name if link.exists() else model_dir.name
    return MemoryNeed(name, weights, weights_how, kv, kv_how, available, available_how)


def lora_slot_bytes(hf_config, max_loras: int, max_lora_rank: int, dtype_bytes: int = 4) -> int:
    """Bytes of the LoRA slots (model/lora.py): per slot, layer and projection, A (rank x
    in) and B (out x rank) of q/k/v/o and gate/up/down."""
    hidden, inter = hf_config.hidden_size, getattr(hf_config, "intermediate_size", 0)
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    # (in + out) of each projection: q, k, v, o, gate, up, down
    sides = (2 * (hidden + heads * head_dim) + 2 * (hidden + kv_heads * head_dim) + 3 * (hidden + inter))
    return max_loras * hf_config.num_hidden_layers * max_lora_rank * sides * dtype_bytes


def memory_need_of(config, model_dir: Path) -> MemoryNeed | None:
    """What a CPU engine of `config` (an EngineConfig) on the model in `model_dir` needs,
    worked out without loading anything: for the figures of a core killed for memory.
    None where it cannot be (a GPU engine, a model directory that does not read)."""
    from gristmill.model.loader.config import load_config, trained_length
    from gristmill.model.loader.gguf_model import GGUF_LINK

    if config.device not in ("auto", "cpu"):
        return None
    try:
        hf_config = load_config(model_dir)
        cpu_config = config.for_device("cpu")
        max_model_len = config.max_model_len or trained_length(model_dir, hf_config)
        quantization = config.quantization
        if quantization == "auto":
            quantization = "gguf" if (model_dir / GGUF_LINK).exists() else "int8"
        dtype_bytes = 2 if config.dtype in ("bfloat16", "float16") else 4
        return cpu_memory_need(model_dir, hf_config, cpu_config, max_model_len, quantization, dtype_bytes)
    except Exception:  # noqa: BLE001 - figures are a help to the message, never its failure
        return None
