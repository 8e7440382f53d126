"""How a GGUF file's model maps onto an HF checkpoint: its architecture and metadata as
an HF config.json, its tensor names as HF parameter names, what each tensor needs beyond
its dequantization (Gemma's norms, llama.cpp's rotary permutation), and gguf's
dequantization over many blocks per call. Imports no torch."""

from __future__ import annotations

import numpy as np

# GGUF architecture -> HF model_type, and config keys read from the GGUF metadata.
# In a GGUF's directory in the cache: a link to the GGUF file its weights are read from.
GGUF_LINK = "model.gguf"

# The block types CPU kernels multiply by as stored (model/cpu/gguf_linear.py).
KERNEL_TYPES = frozenset({"Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q5_K", "Q6_K"})

MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}
_CONFIG_KEYS = {
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


def hf_transform(arch: str, name: str, config: dict):
    """What a tensor needs beyond its dequantization to be the HF checkpoint's, or None."""
    if arch == "gemma3" and name.endswith("norm.weight"):  # (never quantized: vectors)
        return lambda weights: weights - 1.0  # llama.cpp stores Gemma norms as (1 + w)
    heads = _rotary_heads(arch, name, config)
    if heads is not None:
        return lambda weights: unpermute_rotary(weights, heads)
    return None


def rotary_rows(arch: str, name: str, config: dict, num_rows: int) -> np.ndarray | None:
    """For a llama q/k projection (or bias), the file's row of each HF row: llama.cpp
    interleaves each head's two rotary halves; None for every other tensor."""
    heads = _rotary_heads(arch, name, config)
    return None if heads is None else unpermute_rotary(np.arange(num_rows), heads)


def _rotary_heads(arch: str, name: str, config: dict) -> int | None:
    if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
        return config["num_attention_heads"] if ".q_proj." in name else config["num_key_value_heads"]
    return None


# Blocks dequantized per call: whole tensors at once but for the largest (an embedding's
# 5M blocks would take gigabytes of numpy temporaries).
_DEQUANTIZE_CHUNK_BLOCKS = 1 << 16


def dequantize(data: np.ndarray, tensor_type, chunk_blocks: int = _DEQUANTIZE_CHUNK_BLOCKS,
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


def field(reader, key: str, default=None):
    """A metadata value as plain Python (an array of numbers as a list)."""
    value = reader.get(key, default)
    return value.tolist() if isinstance(value, np.ndarray) else value


def _gguf_config(reader, arch: str, model_type: str) -> dict:
    config = {"model_type": model_type, "architectures": [], "torch_dtype": "float32"}
    for key, hf_key in _CONFIG_KEYS.items():
        value = field(reader, f"{arch}.{key}")
        if value is not None:
            config[hf_key] = value
    tokens = reader.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError(f"{reader.path} has no tokenizer.ggml.tokens: a GGUF without its vocabulary "
                         f"cannot be converted")
    config["vocab_size"] = len(tokens)
    theta = field(reader, f"{arch}.rope.freq_base")
    if arch == "gemma3":
        _gemma3_config(reader, config, theta)
    else:
        config["architectures"] = [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                    "qwen3": "Qwen3ForCausalLM"}[arch]]
        config["rope_theta"] = theta or 10_000.0
        config["hidden_act"] = "silu"
    config["bos_token_id"] = field(reader, "tokenizer.ggml.bos_token_id")
    config["eos_token_id"] = _end_of_generation_ids(reader, tokens)
    return config


def _gemma3_config(reader, config: dict, theta: float | None) -> None:
    """Gemma 3's settings, as llama.cpp reads them (src/models/gemma3.cpp): the global
    layers' rope (any linear scaling: the 4B and larger), the sliding layers' own base,
    which layers slide, the attention scale, a final logit softcap where the file has one."""
    config["architectures"] = ["Gemma3ForCausalLM"]
    head_dim = config.get("head_dim", 256)
    # llama.cpp scales attention by 1/sqrt(head_dim) but for the 27B (62 layers), whose
    # config says hidden / heads (168, not its head_dim of 128).
    config["query_pre_attn_scalar"] = (config["hidden_size"] // config["num_attention_heads"]
                                       if config.get("num_hidden_layers") == 62 else head_dim)
    config["rope_parameters"] = {
        "full_attention": {"rope_type": "default", "rope_theta": theta or 1_000_000.0},
        "sliding_attention": {"rope_type": "default",
                              "rope_theta": field(reader, "gemma3.rope.freq_base_swa") or 10_000.0},
    }
    scale = field(reader, "gemma3.rope.scaling.factor")
    if scale and scale != 1.0:
        config["rope_parameters"]["full_attention"] = {
            "rope_type": "linear", "factor": scale, "rope_theta": theta or 1_000_000.0}
    config["layer_types"] = _gemma3_layer_types(reader, config["num_hidden_layers"])
    softcap = field(reader, "gemma3.final_logit_softcapping")
    if softcap:
        config["final_logit_softcapping"] = softcap


def _gemma3_layer_types(reader, num_layers: int) -> list[str]:
    """Which layers attend through the sliding window, as llama.cpp decides: none in a file
    without a window; else as the file's sliding_window_pattern says (a flag per layer, or
    n: each n-th layer global, 0: none), Gemma 3's every sixth layer global when it says
    nothing (what llama.cpp's converter writes)."""
    if not field(reader, "gemma3.attention.sliding_window"):
        return ["full_attention"] * num_layers
    pattern = field(reader, "gemma3.attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):
        sliding = [bool(flag) for flag in pattern[:num_layers]]
    else:
        sliding = [pattern == 0 or i % pattern < pattern - 1 for i in range(num_layers)]
    return ["sliding_attention" if slides else "full_attention" for slides in sliding]


# The tokens llama.cpp ends generation at besides the file's eos, eot and eom ids (it finds
# them by their text: src/llama-vocab.cpp), of those in the supported families'
# vocabularies: the end-of-sequence ids their HF configs list besides the one a GGUF
# keeps (Llama 3.x instruct: <|end_of_text|>, <|eom_id|>, <|eot_id|>; Qwen2.5 and Qwen3:
# <|im_end|>, <|endoftext|>; Gemma 3: <eos>, <end_of_turn>).
_END_OF_GENERATION_TOKENS = frozenset({"<|end_of_text|>", "<|eom_id|>", "<|eot_id|>", "<|im_end|>",
                                       "<|endoftext|>", "<eos>", "<end_of_turn>"})


def _end_of_generation_ids(reader, tokens: list[str]) -> int | list[int] | None:
    """config.json's eos_token_id: the ids generation ends at, the file's eos first."""
    ids = [field(reader, f"tokenizer.ggml.{kind}_token_id") for kind in ("eos", "eot", "eom")]
    ids += [i for i, token in enumerate(tokens) if token in _END_OF_GENERATION_TOKENS]
    ids = list(dict.fromkeys(i for i in ids if i is not None))
    return ids[0] if len(ids) == 1 else ids or None


def hf_tensor_name(gguf_name: str, arch: str) -> str | None:
    """The HF parameter name of GGUF tensor `gguf_name`, or None where it has none."""
    layer_names = _GEMMA_LAYER_TENSORS if arch == "gemma3" else _LAYER_TENSORS
    base, _, kind = gguf_name.rpartition(".")  # kind: weight | bias
    if base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.{kind}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{kind}"
    return None


def llama3_rope_from_factors(factors: np.ndarray, config: dict) -> dict:
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


def unpermute_rotary(weights: np.ndarray, num_heads: int) -> np.ndarray:
    # llama.cpp interleaves the two rotary halves of each head; HF keeps them split.
    head_dim = weights.shape[0] // num_heads
    w = weights.reshape(num_heads, head_dim // 2, 2, *weights.shape[1:])
    return np.ascontiguousarray(w.swapaxes(1, 2).reshape(weights.shape))




def model_config(reader) -> tuple[str, dict]:
    """(the GGUF architecture, the HF config.json) of a GGUFFile; ValueError for an
    architecture gristmill does not run."""
    arch = field(reader, "general.architecture")
    model_type = MODEL_TYPES.get(arch)
    if model_type is None:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {sorted(MODEL_TYPES)}")
    config = _gguf_config(reader, arch, model_type)
    config["tie_word_embeddings"] = "output.weight" not in {t.name for t in reader.tensors}
    factors = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if factors is not None:
        config["rope_scaling"] = llama3_rope_from_factors(np.asarray(factors.data, dtype=np.float32), config)
    return arch, config
