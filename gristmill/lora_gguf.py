"""llama.cpp's LoRA adapter files (what its convert_lora_to_gguf.py writes from a PEFT
adapter, and what `llama-server --lora` takes): a GGUF of `general.type` "adapter",
`adapter.type` "lora", its `adapter.lora.alpha`, and for each projection it updates
`blk.N.<tensor>.weight.lora_a` (rank x in) and `.lora_b` (out x rank), in float32, float16,
bfloat16 or Q8_0. Read without torch, as the PEFT config is (gristmill/lora.py), and given
to the model as the PEFT names and shapes of the same matrices.

llama.cpp's scale is PEFT's plain one, alpha / rank (rank: each module's A's rows; the
file keeps no rsLoRA flag: convert_lora_to_gguf.py writes the alpha as it is). For a
`llama` adapter the converter reorders q's and k's B rows as it does the model's own q
and k (each head's two rotary halves interleaved); `gguf_arch` says so, and the model
side puts them back (model/lora.py).
"""

from __future__ import annotations

import re
from pathlib import Path

from gristmill.errors import LoRAAdapterError

#: llama.cpp's name of each projection an adapter may update -> PEFT's (and the checkpoints').
GGUF_PROJECTIONS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                    "ffn_down": "mlp.down_proj"}
_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.weight\.lora_([ab])")


def is_gguf_adapter(path: Path) -> bool:
    return path.suffix == ".gguf" and not path.is_dir()


def open_adapter(name: str, path: Path):
    """The adapter's GGUFFile, checked to be a LoRA adapter; LoRAAdapterError otherwise."""
    from gristmill.gguf_file import GGUFFile  # (gguf takes a quarter second to import)

    if not path.is_file():
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {path} does not exist; lora_path must be a PEFT adapter "
                               f"directory or a llama.cpp LoRA GGUF file", lora_name=name)
    try:
        reader = GGUFFile(path)
    except (ValueError, OSError) as exc:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {exc}", lora_name=name) from None
    kind, adapter = reader.get("general.type"), reader.get("adapter.type")
    if kind != "adapter" or adapter != "lora":
        what = "a model, not an adapter" if kind in (None, "model") else f"general.type {kind!r}, adapter.type " \
                                                                         f"{adapter!r}"
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {path} is {what}; give a LoRA adapter GGUF (llama.cpp's "
                               f"convert_lora_to_gguf.py writes one from a PEFT adapter)", lora_name=name)
    return reader


def adapter_fields(name: str, path: Path) -> dict:
    """What the config needs of the file: alpha, each module's rank (PEFT's dotted module
    names), the modules it targets and its architecture."""
    reader = open_adapter(name, path)
    alpha = reader.get("adapter.lora.alpha")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {path} has no adapter.lora.alpha", lora_name=name)
    if reader.get("adapter.alora.invocation_tokens") is not None:
        raise LoRAAdapterError(f"LoRA adapter {name!r} is an aLoRA (activated by invocation tokens), which "
                               f"gristmill does not run; use a plain LoRA adapter", lora_name=name)
    ranks, targets = {}, set()
    for tensor in reader.tensors:
        match = _NAME.fullmatch(tensor.name)
        projection = GGUF_PROJECTIONS.get(match.group(2)) if match else None
        if projection is None:
            raise LoRAAdapterError(f"LoRA adapter {name!r} has a tensor {tensor.name!r} that is not a LoRA A or B "
                                   f"matrix of a q/k/v/o or gate/up/down projection; it cannot run here",
                                   lora_name=name)
        if match.group(3) == "a":  # (rank x in: ggml's shape lists `in` first)
            ranks[f"model.layers.{match.group(1)}.{projection}"] = int(tensor.shape[-1])
            targets.add(projection.split(".")[1])
    return {"alpha": float(alpha), "ranks": ranks, "targets": tuple(sorted(targets)),
            "arch": reader.get("general.architecture")}


def read_tensors(name: str, path: Path) -> dict:
    """The adapter's matrices as float32 numpy arrays under PEFT's names and shapes (A: rank x in,
    B: out x rank), as they are in the file (q and k's B rows still in llama.cpp's order
    for a llama adapter)."""
    import gguf
    import numpy as np

    reader = open_adapter(name, path)
    tensors = {}
    for tensor in reader.tensors:
        match = _NAME.fullmatch(tensor.name)
        projection = GGUF_PROJECTIONS.get(match.group(2)) if match else None
        if projection is None:
            raise LoRAAdapterError(f"LoRA adapter {name!r} has a tensor {tensor.name!r} that is not a LoRA A or B "
                                   f"matrix", lora_name=name)
        shape = tuple(reversed(tensor.shape))
        try:
            values = gguf.dequantize(tensor.data, tensor.tensor_type).reshape(shape).astype(np.float32)
        except (ValueError, NotImplementedError) as exc:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {tensor.name} ({tensor.tensor_type.name}) cannot be "
                                   f"read ({exc})", lora_name=name) from None
        which = match.group(3).upper()
        tensors[f"base_model.model.model.layers.{match.group(1)}.{projection}.lora_{which}.weight"] = values
    return tensors
