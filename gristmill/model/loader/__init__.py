"""Find a model, read its config and weights: HF directories and GGUF files.

A GGUF file is converted once into an HF-style directory in the cache (config.json,
model.safetensors, tokenizer files) keyed by the file's path, size and mtime; later
loads read that directory, which takes seconds instead of a dequantize per start.
Where a model argument points and where its conversion is kept are gristmill.paths'.
Finding and converting a model import no torch (a client converts a GGUF before its
engine core starts); loading weights does.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import math
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from gristmill import startup
from gristmill.model.loader.config import ModelConfig, load_config  # noqa: F401 (the loader's API)
from gristmill.paths import converted_gguf_dir, model_source

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# A converted GGUF is an HF directory (float32 model.safetensors, which transformers
# loads too) plus, for its Q8_0 matrices, their own numbers in Q8_0_FILE: int8 values
# (rows, cols) and fp16 scales per block of 32 (rows, cols / 32), named by these
# suffixes. int8 quantization packs those as they are (quant.py) instead of quantizing
# their float32 dequantization again, which gives the same weights.
Q8_0_FILE = "gristmill-q8_0.safetensors"
Q8_0_VALUES, Q8_0_SCALES = ".q8_0", ".q8_0_scale"

# GGUF architecture -> HF model_type, and config keys read from the GGUF metadata.
_GGUF_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}
_GGUF_CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim",
    "attention.sliding_window": "sliding_window",
}
# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.").
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
}
_GEMMA_LAYER_TENSORS = {**_LAYER_TENSORS, "ffn_norm": "pre_feedforward_layernorm",
                        "post_attention_norm": "post_attention_layernorm",
                        "post_ffw_norm": "post_feedforward_layernorm"}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                   "output": "lm_head"}


def resolve_model(model: str | None, cache_dir: str | None = None) -> Path:
    """The HF-style directory of `model` (None = the bundled default); a GGUF file is
    converted into the cache the first time."""
    path = model_source(model, cache_dir)
    if path.is_dir():
        return path
    target = converted_gguf_dir(path, cache_dir)
    what = f"converting {path.name} to safetensors"
    if (target / "model.safetensors").exists():
        startup.cached(what, target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        with startup.phase(what, target):
            convert_gguf(path, tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process finished the same conversion first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Convert a GGUF file into config.json + model.safetensors (float32) + tokenizer
    files, and Q8_0_FILE with its Q8_0 matrices as they are."""
    from gristmill.model.loader.gguf_file import GGUFFile

    reader = GGUFFile(gguf_path)
    arch = _field(reader, "general.architecture")
    model_type = _GGUF_MODEL_TYPES.get(arch)
    if model_type is None:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {sorted(_GGUF_MODEL_TYPES)}")
    config = _gguf_config(reader, arch, model_type)
    # The tokenizer (Python and Rust: mostly holding the GIL) is built on a thread while the
    # weights (numpy and the file writes: mostly not) are converted here.
    tokenizer = concurrent.futures.ThreadPoolExecutor(1, "gristmill-gguf-tokenizer")
    from gristmill.model.loader.gguf_tokenizer import convert_gguf_tokenizer
    converting = tokenizer.submit(convert_gguf_tokenizer, reader.fields, model_type, out_dir, gguf_path)
    try:
        _convert_gguf_weights(reader, arch, config, out_dir)
    finally:
        tokenizer.shutdown(wait=True)  # (out_dir is removed on an error: not while it writes there)
    converting.result()
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))


def _convert_gguf_weights(reader, arch: str, config: dict, out_dir: Path) -> None:
    """model.safetensors and Q8_0_FILE, each tensor dequantized and written a piece at a
    time through one reused buffer (no gigabyte of fresh memory to fault in); sets
    config's tie_word_embeddings (and rope_scaling where the file holds llama3 rope
    factors)."""
    import gguf

    from gristmill.model.loader.safetensors_io import write_safetensors

    layer_names = _GEMMA_LAYER_TENSORS if arch == "gemma3" else _LAYER_TENSORS
    floats, blocks = [], []
    buffer = np.empty(_PIECE_BYTES, dtype=np.uint8)
    for tensor in reader.tensors:
        name = _hf_tensor_name(tensor.name, layer_names)
        if name is None:
            if tensor.name == "rope_freqs.weight":
                config["rope_scaling"] = _llama3_rope_from_factors(
                    np.asarray(tensor.data, dtype=np.float32), config)
                continue
            raise ValueError(f"GGUF tensor {tensor.name!r} has no place in a {arch} model")
        transform = _hf_transform(arch, name, config)
        shape = tuple(reversed(tensor.shape))
        floats.append(_tensor_source(name, np.float32, shape, tensor.data, buffer, transform,
                                     lambda rows, out, t=tensor: _dequantize(rows, t.tensor_type, out=out)))
        if tensor.tensor_type == gguf.GGMLQuantizationType.Q8_0 and len(shape) == 2:
            for suffix, dtype, columns, part in ((Q8_0_VALUES, np.int8, shape[1], _q8_0_values),
                                                 (Q8_0_SCALES, np.float16, shape[1] // 32, _q8_0_scales)):
                blocks.append(_tensor_source(name + suffix, dtype, (shape[0], columns), tensor.data, buffer,
                                             transform, part))
    config["tie_word_embeddings"] = "lm_head.weight" not in {t.name for t in floats}
    write_safetensors(out_dir / "model.safetensors", floats, metadata={"format": "pt"})  # as torch writes it
    if blocks:
        write_safetensors(out_dir / Q8_0_FILE, blocks)


# The bytes of one piece of a tensor as it is converted (the buffer every piece reuses).
_PIECE_BYTES = 8 << 20


def _tensor_source(name: str, dtype, shape: tuple[int, ...], data: np.ndarray, buffer: np.ndarray,
                   transform, convert):
    """A tensor of the converted checkpoint: `convert(rows, out)` turns rows of the GGUF
    tensor's `data` into its values (written into `out`, a flat `dtype` array, when one
    is given). Pieces of whole rows that fit in `buffer`; the whole tensor at once where
    `transform` (a function of the whole tensor) applies."""
    from gristmill.model.loader.safetensors_io import TensorSource

    rows = data.reshape(-1, data.shape[-1])
    row_items = math.prod(shape) // len(rows)

    def pieces():
        if transform is not None:
            yield np.ascontiguousarray(transform(convert(rows, None).reshape(shape)), dtype=dtype)
            return
        out = buffer.view(dtype)
        step = max(1, len(out) // max(row_items, 1))
        for start in range(0, len(rows), step):
            chunk = rows[start:start + step]
            piece = convert(chunk, out if len(chunk) * row_items <= len(out) else None)
            yield np.ascontiguousarray(piece, dtype=dtype)

    return TensorSource(name, np.dtype(dtype), shape, pieces)


def _hf_transform(arch: str, name: str, config: dict):
    """What a tensor needs beyond its dequantization to be the HF checkpoint's, or None."""
    if arch == "gemma3" and name.endswith("norm.weight"):  # (never Q8_0: vectors)
        return lambda weights: weights - 1.0  # llama.cpp stores Gemma norms as (1 + w)
    if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
        heads = config["num_attention_heads"] if ".q_proj." in name else config["num_key_value_heads"]
        return lambda weights: _unpermute_rotary(weights, heads)
    return None


# Blocks dequantized per call: whole tensors at once but for the largest (an embedding's
# 5M blocks would take gigabytes of numpy temporaries).
_DEQUANTIZE_CHUNK_BLOCKS = 1 << 16


def _dequantize(data: np.ndarray, tensor_type, chunk_blocks: int = _DEQUANTIZE_CHUNK_BLOCKS,
                out: np.ndarray | None = None) -> np.ndarray:
    """`gguf.dequantize(data, tensor_type)`, the same numbers (flattened): gguf's own
    per-type block arithmetic, but over many blocks per call instead of 16 rows at a time,
    whose per-call overhead took most of a conversion's dequantization time; and for the
    types that are an fp16 scale times small integers (Q8_0, Q5_0, Q4_0), that product
    written straight into the output, without gguf's float32 temporaries. `out`: a flat
    float32 array at least that long to write the numbers into (a view of it is returned)."""
    import gguf

    quant = getattr(gguf.quants, tensor_type.name, None)
    block_size, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
    if quant is None or not hasattr(quant, "dequantize_blocks") or block_size == 1:
        return gguf.dequantize(data, tensor_type).reshape(-1)  # (F32, F16, ...: plain values)
    quant.init_grid()
    codes = _SCALED_CODES.get(tensor_type.name)
    blocks = np.asarray(data).view(np.uint8).reshape(-1, type_size)
    size = len(blocks) * block_size
    out = (np.empty(size, dtype=np.float32) if out is None else out[:size]).reshape(len(blocks), block_size)
    for start in range(0, len(blocks), chunk_blocks):
        chunk, chunk_out = blocks[start:start + chunk_blocks], out[start:start + chunk_blocks]
        if codes is None:
            chunk_out[:] = quant.dequantize_blocks(chunk)
        else:  # (int8 codes and an fp16 scale are exact in float32: gguf's product, bit for bit)
            chunk_out[:] = codes(chunk)
            chunk_out *= chunk[:, :2].view(np.float16).astype(np.float32)
    return out.reshape(-1)


def _low_high_nibbles(quants: np.ndarray) -> np.ndarray:
    """A block's 4-bit values: the low nibbles of its bytes, then the high ones. (blocks, 2 * bytes)"""
    return np.concatenate([quants & 0x0F, quants >> 4], axis=1)


# The integer codes (int8, (blocks, 32)) of the blocks of a type whose block is an fp16
# scale (2 bytes) and the codes, as ggml packs them.
_SCALED_CODES = {
    "Q8_0": lambda blocks: blocks[:, 2:].view(np.int8),
    "Q4_0": lambda blocks: _low_high_nibbles(blocks[:, 2:]).view(np.int8) - np.int8(8),
    # Q5_0: the fifth bits, bit i of a little-endian uint32 for value i, then 16 bytes of nibbles.
    "Q5_0": lambda blocks: (_low_high_nibbles(blocks[:, 6:]) | np.unpackbits(blocks[:, 2:6], axis=1, bitorder="little")
                            << np.uint8(4)).view(np.int8) - np.int8(16),
}


def _q8_0_values(rows: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    """Rows of a Q8_0 matrix's own int8 values (rows, cols), from its blocks (per block: an
    fp16 scale, then 32 int8 values); written into `out` (flat int8) when given."""
    values = rows.reshape(-1, 34)[:, 2:].view(np.int8)
    if out is None:
        return np.ascontiguousarray(values).reshape(len(rows), -1)
    np.copyto(out[:values.size].reshape(values.shape), values)
    return out[:values.size].reshape(len(rows), -1)


def _q8_0_scales(rows: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    """Rows of a Q8_0 matrix's fp16 block scales (rows, cols / 32)."""
    return np.ascontiguousarray(rows.reshape(-1, 34)[:, :2]).view(np.float16).reshape(len(rows), -1)


def _field(reader, key: str, default=None):
    """A metadata value as plain Python (an array of numbers as a list)."""
    value = reader.get(key, default)
    return value.tolist() if isinstance(value, np.ndarray) else value


def _gguf_config(reader, arch: str, model_type: str) -> dict:
    config = {"model_type": model_type, "architectures": [], "torch_dtype": "float32"}
    for key, hf_key in _GGUF_CONFIG_KEYS.items():
        value = _field(reader, f"{arch}.{key}")
        if value is not None:
            config[hf_key] = value
    tokens = reader.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError(f"{reader.path} has no tokenizer.ggml.tokens: a GGUF without its vocabulary "
                         f"cannot be converted")
    config["vocab_size"] = len(tokens)
    theta = _field(reader, f"{arch}.rope.freq_base")
    if arch == "gemma3":
        config["architectures"] = ["Gemma3ForCausalLM"]
        config["query_pre_attn_scalar"] = config.get("head_dim", 256)
        config["rope_parameters"] = {
            "full_attention": {"rope_type": "default", "rope_theta": theta or 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        }
        scale = _field(reader, f"{arch}.rope.scaling.factor")
        if scale and scale != 1.0:
            config["rope_parameters"]["full_attention"] = {
                "rope_type": "linear", "factor": scale, "rope_theta": theta}
    else:
        config["architectures"] = [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                    "qwen3": "Qwen3ForCausalLM"}[arch]]
        config["rope_theta"] = theta or 10_000.0
        config["hidden_act"] = "silu"
    config["bos_token_id"] = _field(reader, "tokenizer.ggml.bos_token_id")
    config["eos_token_id"] = _field(reader, "tokenizer.ggml.eos_token_id")
    return config


def _hf_tensor_name(gguf_name: str, layer_names: dict) -> str | None:
    base, _, kind = gguf_name.rpartition(".")  # kind: weight | bias
    if base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.{kind}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{kind}"
    return None


def _llama3_rope_from_factors(factors: np.ndarray, config: dict) -> dict:
    """llama.cpp stores llama3 rope scaling as per-frequency divisors; find the HF
    parameters that give the same divisors."""
    from gristmill.model.layers.rotary import rope_inv_freq

    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    base = {"rope_theta": config["rope_theta"]}
    plain = rope_inv_freq(head_dim, base).numpy()
    for original in (8192, 4096, 16384, 32768):
        params = {"rope_type": "llama3", "factor": float(factors.max()), "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": original}
        scaled = rope_inv_freq(head_dim, {**base, **params}).numpy()
        if np.allclose(plain / scaled, factors, rtol=1e-3):
            return params
    raise ValueError("this GGUF's rope_freqs do not match llama3 rope scaling with the usual "
                     "parameters; convert the model from its HF directory instead")


def _unpermute_rotary(weights: np.ndarray, num_heads: int) -> np.ndarray:
    # llama.cpp interleaves the two rotary halves of each head; HF keeps them split.
    head_dim = weights.shape[0] // num_heads
    w = weights.reshape(num_heads, head_dim // 2, 2, *weights.shape[1:])
    return np.ascontiguousarray(w.swapaxes(1, 2).reshape(weights.shape))


def load_weights(model: torch.nn.Module, model_dir: Path, skip: set[str] = frozenset(),
                 q8_0: bool = False) -> None:
    """Copy every `*.safetensors` tensor of `model_dir` into `model`; all must be used,
    but those named in `skip` (weights the model holds in another form already). With
    `q8_0`, a converted GGUF's Q8_0 matrices are given to their parameters as they are
    (`param.q8_0 = (values, scales)`), for int8 quantization."""
    import torch
    from safetensors import safe_open

    files = sorted(f for f in model_dir.glob("*.safetensors") if f.name != Q8_0_FILE)
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    params = dict(model.named_parameters())
    # A family whose parameter names are not its checkpoints' maps them (None: a tensor it leaves out).
    rename = getattr(model, "checkpoint_name", None) or (lambda name: name.removeprefix("language_model."))
    loaded = set()
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    target_name = rename(name)
                    if target_name is None or target_name in skip:
                        continue
                    if target_name not in params:
                        if "rotary_emb" in name:
                            continue
                        raise ValueError(f"checkpoint tensor {name!r} in {file.name} does not fit "
                                         f"this {type(model).__name__}")
                    params[target_name].copy_(f.get_tensor(name))
                    loaded.add(target_name)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    missing = set(params) - loaded - tied
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks {sorted(missing)[:5]} "
                         f"({len(missing)} tensors missing)")
    if q8_0 and (model_dir / Q8_0_FILE).exists():
        with safe_open(str(model_dir / Q8_0_FILE), framework="pt") as f:
            for name in f.keys():
                target_name = name.removesuffix(Q8_0_VALUES)
                if name.endswith(Q8_0_VALUES) and target_name in loaded:
                    params[target_name].q8_0 = (f.get_tensor(name), f.get_tensor(target_name + Q8_0_SCALES))
