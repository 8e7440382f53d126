"""The GGUF files of benchmarks/sizes.py: random weights at the real shapes of Llama 3.2 1B,
Qwen3-4B and Llama 3.1 8B, with the metadata llama.cpp's converter writes for them (the
`llama` and `qwen3` keys, rope freq base, llama3 rope scaling as `rope_freqs.weight`) and
the real tokenizers (llama.cpp's vocab-only files `ggml-vocab-llama-bpe.gguf` and
`ggml-vocab-qwen2.gguf`, whose 128256 and 151936 tokens are those models' vocab sizes).

Q8_0 and Q4_0 are written here with the gguf package, every matrix in that type (as
`llama-quantize --pure` would: a real Q4_0 file keeps its output matrix in Q6_K).
Random weights need no real quantization: each block is random codes from a pool of
random bytes under one fp16 scale that gives the weights a std of 0.02, and norms are
ones, so activations stay finite through every layer. Q4_K_M is made from the Q8_0 file
by llama.cpp's `llama-quantize --allow-requantize`. The bundled Gemma 3 270M (`270m`) is
its real Q4_K_M file; its Q8_0 and Q4_0 are requantized from it by llama-quantize.

Files are written under a temporary name and renamed when whole, so a file that is there
is reused by later runs."""

from __future__ import annotations

import math
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TYPES = ("q8_0", "q4_0", "q4_k_m")
WEIGHT_STD = 0.02
# (bytes per block of 32, std of the block's integer codes): Q8_0 codes are uniform int8,
# Q4_0 codes uniform in [-8, 7] (16 / sqrt(12)).
_BLOCKS = {"q8_0": (34, 256 / math.sqrt(12)), "q4_0": (18, 16 / math.sqrt(12))}
_POOL_BYTES = (1 << 24) + 4099  # (not a multiple of any row's bytes, so rows differ)


@dataclass(frozen=True)
class ModelShape:
    """One model's shape and the metadata llama.cpp writes for it (from its config.json)."""
    name: str
    arch: str  # the GGUF architecture: the metadata keys' prefix
    vocab_file: str  # llama.cpp's vocab-only GGUF holding its tokenizer
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_size: int
    vocab_size: int
    tied_output: bool  # the embedding table is also the LM head (no output.weight)
    context_length: int
    rope_theta: float
    rms_norm_eps: float
    llama3_rope_factor: float | None = None  # llama3 rope scaling: low 1, high 4, original 8192

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """(GGUF name, numpy shape) of every tensor, in the converter's order; a 2-D
        shape is (out, in)."""
        hidden, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        out = [("rope_freqs.weight", (self.head_dim // 2,))] if self.llama3_rope_factor else []
        out.append(("token_embd.weight", (self.vocab_size, hidden)))
        for i in range(self.num_layers):
            layer = [("attn_norm", (hidden,)), ("attn_q", (q, hidden)), ("attn_k", (kv, hidden)),
                     ("attn_v", (kv, hidden)), ("attn_output", (hidden, q))]
            if self.arch == "qwen3":
                layer += [("attn_q_norm", (self.head_dim,)), ("attn_k_norm", (self.head_dim,))]
            layer += [("ffn_norm", (hidden,)), ("ffn_gate", (self.ffn_size, hidden)),
                      ("ffn_up", (self.ffn_size, hidden)), ("ffn_down", (hidden, self.ffn_size))]
            out += [(f"blk.{i}.{name}.weight", shape) for name, shape in layer]
        out.append(("output_norm.weight", (hidden,)))
        if not self.tied_output:
            out.append(("output.weight", (self.vocab_size, hidden)))
        return out

    def rope_factors(self) -> np.ndarray:
        """llama.cpp's converter's `rope_freqs` for llama3 rope scaling: each frequency's divisor."""
        freqs = 1.0 / (self.rope_theta ** (np.arange(0, self.head_dim, 2, dtype=np.float32) / self.head_dim))
        factor, low, high, original = self.llama3_rope_factor, 1.0, 4.0, 8192
        wavelen = 2 * np.pi / freqs
        smooth = (original / wavelen - low) / (high - low)
        mid = 1 / ((1 - smooth) / factor + smooth)
        divisors = np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, mid))
        return divisors.astype(np.float32)


#: --sizes name -> the model's shape (from its config.json on the Hugging Face hub).
SHAPES = {
    "1b": ModelShape("Llama-3.2-1B", "llama", "ggml-vocab-llama-bpe.gguf", hidden_size=2048, num_layers=16,
                     num_heads=32, num_kv_heads=8, head_dim=64, ffn_size=8192, vocab_size=128256,
                     tied_output=True, context_length=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                     llama3_rope_factor=32.0),
    "4b": ModelShape("Qwen3-4B", "qwen3", "ggml-vocab-qwen2.gguf", hidden_size=2560, num_layers=36,
                     num_heads=32, num_kv_heads=8, head_dim=128, ffn_size=9728, vocab_size=151936,
                     tied_output=True, context_length=40960, rope_theta=1000000.0, rms_norm_eps=1e-6),
    "8b": ModelShape("Llama-3.1-8B", "llama", "ggml-vocab-llama-bpe.gguf", hidden_size=4096, num_layers=32,
                     num_heads=32, num_kv_heads=8, head_dim=128, ffn_size=14336, vocab_size=128256,
                     tied_output=False, context_length=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                     llama3_rope_factor=8.0),
}
BUNDLED = "270m"  # the bundled Gemma 3 270M, a real Q4_K_M file


def model_file(size: str, file_type: str, out_dir: Path, vocab_dir: Path, quantize: Path | None) -> Path:
    """The GGUF file of `size` in `file_type`, made into `out_dir` unless it is there.
    `vocab_dir`: llama.cpp's models/ (the vocab-only files); `quantize`: llama-quantize,
    or None where it is not built (then a file that needs it is a RuntimeError)."""
    if size == BUNDLED:
        from gristmill.paths import default_model_path
        bundled = default_model_path()
        if file_type == "q4_k_m":
            return bundled
        return _requantized(bundled, out_dir / f"gemma-3-270m-{file_type.upper()}.gguf", file_type, quantize)
    shape = SHAPES[size]
    path = out_dir / f"{shape.name}-random-{file_type.upper()}.gguf"
    if file_type == "q4_k_m":
        source = model_file(size, "q8_0", out_dir, vocab_dir, quantize)
        return _requantized(source, path, file_type, quantize)
    if not path.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        part = path.with_suffix(".part")
        write_random_gguf(shape, file_type, part, vocab_dir / shape.vocab_file)
        part.replace(path)
    return path


def _requantized(source: Path, path: Path, file_type: str, quantize: Path | None) -> Path:
    if path.exists():
        return path
    if quantize is None:
        raise RuntimeError(f"{path.name} is made by llama-quantize, which is not built (drop --skip-llama-cpp "
                           f"or pass --llama-cpp DIR)")
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_suffix(".part")
    done = subprocess.run([str(quantize), "--allow-requantize", str(source), str(part), file_type.upper()],
                          capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"llama-quantize {source.name} -> {file_type} failed: {done.stderr.strip()[-500:]}")
    part.replace(path)
    return path


def write_random_gguf(shape: ModelShape, file_type: str, path: Path, vocab_path: Path) -> None:
    """A GGUF of `shape` with random `file_type` blocks, written one tensor at a time (a
    tensor's bytes are made just before they are written, so memory stays at one tensor)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), shape.arch)
    _add_metadata(writer, shape, file_type)
    _copy_tokenizer(writer, vocab_path)
    qtype = gguf.GGMLQuantizationType[file_type.upper()]
    block_bytes, _ = _BLOCKS[file_type]
    for name, dims in shape.tensors():
        if len(dims) == 1:
            writer.add_tensor_info(name, dims, np.dtype(np.float32), 4 * dims[0])
        else:
            writer.add_tensor_info(name, dims, np.dtype(np.float32), math.prod(dims) // 32 * block_bytes,
                                   raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    pool = np.random.default_rng(0).integers(0, 256, _POOL_BYTES, dtype=np.uint8)
    for i, (name, dims) in enumerate(shape.tensors()):
        if name == "rope_freqs.weight":
            writer.write_tensor_data(shape.rope_factors())
        elif len(dims) == 1:
            writer.write_tensor_data(np.ones(dims, dtype=np.float32))  # (RMSNorm weights)
        else:
            writer.write_tensor_data(random_blocks(math.prod(dims) // 32, file_type, pool, offset=i * 7919))
    writer.close()


def random_blocks(num_blocks: int, file_type: str, pool: np.ndarray, offset: int) -> np.ndarray:
    """`num_blocks` blocks of `file_type` (Q8_0 or Q4_0) as bytes: codes from `pool` (read as
    a loop from `offset`), each block's fp16 scale the one that makes the weights' std
    WEIGHT_STD. (num_blocks, block bytes) uint8"""
    block_bytes, code_std = _BLOCKS[file_type]
    blocks = np.resize(np.roll(pool, -offset), num_blocks * block_bytes).reshape(num_blocks, block_bytes)
    blocks[:, :2] = np.frombuffer(np.float16(WEIGHT_STD / code_std).tobytes(), dtype=np.uint8)
    return blocks


def _add_metadata(writer, shape: ModelShape, file_type: str) -> None:
    import gguf

    writer.add_name(shape.name)
    writer.add_block_count(shape.num_layers)
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.hidden_size)
    writer.add_feed_forward_length(shape.ffn_size)
    writer.add_head_count(shape.num_heads)
    writer.add_head_count_kv(shape.num_kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_norm_eps)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_file_type(gguf.LlamaFileType[f"MOSTLY_{file_type.upper()}"])
    if shape.arch == "llama":  # (LlamaModel's own keys)
        writer.add_vocab_size(shape.vocab_size)
        writer.add_rope_dimension_count(shape.head_dim)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _copy_tokenizer(writer, vocab_path: Path) -> None:
    """Every `tokenizer.*` key of llama.cpp's vocab-only file, with its types. (Read with
    gristmill's GGUF reader: gguf.GGUFReader takes most of a minute over 400k strings.)"""
    from gristmill.gguf_file import GGUFFile

    vocab = GGUFFile(vocab_path)
    for key, value in vocab.fields.items():
        if key.startswith("tokenizer."):
            value_type, element_type = vocab.field_types[key]
            writer.add_key_value(key, value.tolist() if isinstance(value, np.ndarray) else value,
                                 value_type, sub_type=element_type)


def weight_bytes_per_token(path: Path) -> tuple[int, int]:
    """(the file's tensor bytes, the bytes a batch-1 decode step reads: all of them but
    the embedding table where it is not also the LM head, as a lookup reads one row)."""
    from gristmill.gguf_file import GGUFFile

    tensors = {t.name: t.n_bytes for t in GGUFFile(path).tensors}
    total = sum(tensors.values())
    return total, total - (tensors["token_embd.weight"] if "output.weight" in tensors else 0)
